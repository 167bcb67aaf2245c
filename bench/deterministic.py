"""What the deterministic mode costs: step time of ``Local(GPT, deterministic=G)`` against the
default ``Local(GPT)``, one process, float32 and bf16 (fp32 masters) side by side; and the
same mode with one pass per granule (``Deterministic(G, batched=False)``, "loop"), the path
a pipeline and a mixture of experts still take.

    python bench/deterministic.py                       # both sizes, one BLAS thread
    python bench/deterministic.py --sizes lesson --repeats 3

Sizes as in bench/step_time.py: ``lesson`` (2 layers, 4 heads, n_embd 64, T 32, batch 16)
and ``large`` (4 layers, 8 heads, n_embd 512, T 256, batch 8). The granule count G is
``--granules`` (default 16, the largest dp * microbatches the default mode accepts), capped
at the batch (one row per granule). A step is forward + backward + AdamW; the runs are
interleaved (default, deterministic, default, ...) so load from other processes hits both
alike; per precision: the median step of each mode, their ratio (and the loop's), the ratio of the fastest
repeats, and the spread (max / min) of the deterministic repeats. The header names the CPU,
cores, BLAS, load and date (bench/machine.py); the JSON goes to
bench/results/deterministic.json.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

from machine import report  # noqa: E402
from step_time import SIZES, VOCAB  # noqa: E402

from pdist.course import lesson  # noqa: E402
from pdist.engine import precision  # noqa: E402
from pdist.parallel.deterministic import Deterministic  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.parallel import Local, MixedPrecision  # noqa: E402


def step_fn(cfg, prec, det, x, y):
    """One training step (forward_backward + AdamW) of a fresh model; returns its seconds."""
    model = GPT(cfg, seed=0)
    s = Local(model if prec == "fp32" else precision.cast_module(model, prec), deterministic=det)
    s = s if prec == "fp32" else MixedPrecision(s, prec)
    opt = lesson.make_adamw(s.parameters())

    def step():
        t0 = time.perf_counter()
        s.forward_backward(x, y)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return time.perf_counter() - t0
    return step


def run(size, precs, granules, repeats):
    shape, B, default_repeats = SIZES[size]
    repeats = repeats or default_repeats
    G = min(granules, B)
    cfg = lesson.gpt_config(VOCAB, **shape)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, VOCAB, (B, cfg.block_size)) for _ in range(2))
    rows, out = [], []
    for prec in precs:
        steps = {"default": step_fn(cfg, prec, False, x, y), "deterministic": step_fn(cfg, prec, G, x, y),
                 "loop": step_fn(cfg, prec, Deterministic(G, batched=False), x, y)}
        for s in steps.values():
            s()                                          # warm: caches, first allocations
        times = {k: [] for k in steps}
        for _ in range(repeats):
            for k, s in steps.items():
                times[k].append(s())
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio, ratio_min = med["deterministic"] / med["default"], min(times["deterministic"]) / min(times["default"])
        spread = max(times["deterministic"]) / min(times["deterministic"])
        loop = med["loop"] / med["default"]
        rows.append((prec, f"{med['default'] * 1e3:.1f}", f"{med['deterministic'] * 1e3:.1f}", f"{ratio:.2f}x",
                     f"{ratio_min:.2f}x", f"{spread:.2f}", f"{med['loop'] * 1e3:.1f}", f"{loop:.2f}x"))
        out.append({"size": size, "precision": prec, "granules": G, "batch": B, "repeats": repeats,
                    "default_ms": med["default"] * 1e3, "deterministic_ms": med["deterministic"] * 1e3,
                    "ratio": ratio, "ratio_of_mins": ratio_min, "loop_ms": med["loop"] * 1e3, "loop_ratio": loop})
    print(f"\n{size}: {shape}, batch {B}, granules {G} ({B // G} rows each), {repeats} interleaved repeats")
    print(lesson.table(rows, ["precision", "default ms", "deterministic ms", "ratio", "ratio of mins",
                              "spread", "loop ms", "loop ratio"]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    p.add_argument("--granules", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="timed steps per mode (default per size)")
    args = p.parse_args()
    load0 = os.getloadavg()[0]
    with threadpool_limits(1):
        results = [r for size in args.sizes for r in run(size, args.precisions, args.granules, args.repeats)]
    print(f"\nload average {load0:.2f} before, {os.getloadavg()[0]:.2f} after; one BLAS thread")
    report("deterministic", {"rows": results})


if __name__ == "__main__":
    main()
