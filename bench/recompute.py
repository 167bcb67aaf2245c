"""What activation recomputation costs and saves: step time and activation memory of
pdist's GPT with ``recompute="none" | "selective" | "full"`` (pdist/engine/recompute.py).

    python bench/recompute.py                          # both sizes, float32, one BLAS thread
    python bench/recompute.py --sizes large --repeats 5

Sizes as in bench/step_time.py: ``lesson`` (2 layers, 4 heads, n_embd 64, T 32, batch
16) and ``large`` (4 layers, 8 heads, n_embd 512, T 256, batch 8). Per size:

  time     median step (forward + backward + AdamW) per mode, the three runs interleaved
           (none, selective, full, none, ...) so load from other processes hits all alike;
           ratio = median / median of "none", and the same for the fastest repeats (a loaded
           machine slows some repeats, rarely all); the fastest forward and backward (+ AdamW)
           apart; spread = max/min of that mode's repeats
  memory   per layer: Korthikanti et al.'s sbh(34 + 5as/h) (16-bit, dropout), pdist's own
           formula (pdist/measure/activation_memory.py) and the measurement (the unique buffers
           the graph of one block keeps alive); and the peak of a whole step
           (tracemalloc, all Python and NumPy allocations, model state included)

The load average (1 min) is printed before and after: the numbers are only as quiet
as the machine.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

from step_time import SIZES, VOCAB  # noqa: E402

from pdist.measure import activation_memory as am  # noqa: E402
from pdist.course import lesson  # noqa: E402
from pdist.engine.autograd import Tensor  # noqa: E402
from pdist.engine.backend import set_default_dtype  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.engine.recompute import MODES  # noqa: E402


def phased_step_fn(cfg, x, y):
    """One training step that returns (forward s, backward + AdamW s)."""
    model = GPT(cfg, seed=0)
    opt = lesson.make_adamw(model.parameters())

    def step():
        model.zero_grad()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        opt.step()
        return t1 - t0, time.perf_counter() - t1
    return step


def step_times(cfg, x, y, repeats):
    """{mode: [(forward s, backward + step s), ...]}, the modes interleaved."""
    steps = {m: phased_step_fn(dataclasses.replace(cfg, recompute=m), x, y) for m in MODES}
    for s in steps.values():
        s()                                              # warm: caches, first allocations
    times = {m: [] for m in MODES}
    for _ in range(repeats):
        for m in MODES:
            times[m].append(steps[m]())
    return times


def step_peak(cfg, x, y):
    step = phased_step_fn(cfg, x, y)
    step()
    tracemalloc.start()
    try:
        step()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def layer_bytes(cfg, B):
    block = GPT(cfg, seed=0).transformer.h[0]
    x = Tensor(np.random.default_rng(0).standard_normal((B, cfg.block_size, cfg.n_embd)), requires_grad=True,
               dtype=cfg.dtype)
    measured, out = am.measure_block(block, x)
    out.sum().backward()
    return measured


def run(size, dtype, repeats):
    shape, B, default_repeats = SIZES[size]
    cfg = lesson.gpt_config(VOCAB, dtype=dtype, **shape)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, VOCAB, (B, cfg.block_size)) for _ in range(2))
    phases = step_times(cfg, x, y, repeats or default_repeats)
    times = {m: [f + b for f, b in v] for m, v in phases.items()}
    base, fastest = statistics.median(times["none"]), min(times["none"])
    rows = []
    for m in MODES:
        c = dataclasses.replace(cfg, recompute=m)
        med = statistics.median(times[m])
        fwd, bwd = (min(v[i] for v in phases[m]) for i in (0, 1))
        rows.append((m, f"{med * 1e3:.1f}", f"{med / base:.2f}x", f"{min(times[m]) / fastest:.2f}x",
                     f"{fwd * 1e3:.1f} / {bwd * 1e3:.1f}", f"{max(times[m]) / min(times[m]):.2f}",
                     lesson.fmt_bytes(am.paper_bytes(c, B, m)),
                     lesson.fmt_bytes(am.formula_bytes(c, B, m, np.dtype(dtype).itemsize)),
                     lesson.fmt_bytes(layer_bytes(c, B)), lesson.fmt_bytes(step_peak(c, x, y))))
    head = ["recompute", "ms/step", "ratio", "ratio of mins", "min fwd / bwd ms", "spread", "paper/layer",
            "formula/layer", "measured/layer", "step peak"]
    print(f"\n{size}: {shape}, batch {B}, {dtype}, {repeats or default_repeats} interleaved repeats")
    print(lesson.table(rows, head))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per mode (default per size)")
    args = p.parse_args()
    set_default_dtype(args.dtype)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, one BLAS thread, "
          f"load average {os.getloadavg()[0]:.2f} before")
    with threadpool_limits(1):
        for size in args.sizes:
            run(size, args.dtype, args.repeats)
    print(f"\nload average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
