"""Step time of tensor parallelism on this machine: TensorParallel(GPT) over t = 2 ranks (one
BLAS thread each, with and without sequence parallelism) next to one process (with one and
with two BLAS threads), same model, same global batch, forward + backward + AdamW.

    python bench/tensor_parallel.py                       # sizes lesson and wide, float32
    python bench/tensor_parallel.py --sizes wide --repeats 5 --steps 6 --dtype float64

The script launches itself under mpiexec (pdist.testing.mpirun) once per configuration and
repeat, interleaved (1 proc 1 thread, 1 proc 2 threads, TP=2, TP=2+SP, then again), so load
from other processes on a shared machine hits all alike. Each launch times --steps steps after
one warm-up step and reports its median; the table gives the median over repeats, the spread
(max/min over repeats) as a noise gauge, and for TP the median time per step spent inside
collectives (trace.comm_seconds: issue to completion, rank 0).

Sizes: ``lesson`` = pdist.course.lesson.gpt_config (2 layers, 4 heads, n_embd 64, T 32) at batch 8;
``wide`` = 4 layers, 8 heads, n_embd 256, T 128, batch 8: matmul-heavy enough for the split
work to show. Ideal TP=2 speed-up over one thread is 2x, minus 4 all-reduces of B*T*C per layer.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SIZES = {"lesson": (dict(block_size=32, n_layer=2, n_head=4, n_embd=64), 8),
         "wide": (dict(block_size=128, n_layer=4, n_head=8, n_embd=256), 8)}
CONFIGS = [("1 process, 1 thread", 1, "single", 1), ("1 process, 2 threads", 1, "single", 2),
           ("TP=2, 1 thread/rank", 2, "tp", 1), ("TP=2 + SP, 1 thread/rank", 2, "tp_sp", 1)]


def worker(a):
    """Runs under mpiexec: time a.steps training steps, print one JSON line on rank 0."""
    from threadpoolctl import threadpool_limits
    from pdist import comm, data
    from pdist.models import gpt
    from pdist.course import lesson
    from pdist.measure import trace
    from pdist.engine.backend import set_default_dtype, synchronize
    from pdist.parallel import Local, TensorParallel
    from pdist.training import train
    world = comm.init()
    threadpool_limits(limits=a.threads)
    set_default_dtype(a.dtype)
    kw, B = SIZES[a.size]
    tokens, tok = data.char_dataset()
    cfg = gpt.GPTConfig(vocab_size=tok.vocab_size, dtype=a.dtype, **kw)
    model = (Local(gpt.GPT(cfg, seed=0)) if a.layout == "single"
             else TensorParallel(gpt.GPT(cfg, seed=0), world, sequence_parallel=a.layout == "tp_sp"))
    opt = lesson.make_adamw(model.parameters())
    times, comm_s, t0 = [], [], [0.0]

    def batch(step):
        world.barrier()
        trace.clear()
        t0[0] = time.perf_counter()
        return data.get_batch(tokens, B, cfg.block_size, 0, step)

    def on_step(step, loss):
        if step:  # the first step warms up allocations
            synchronize()  # the step's device work is done (no-op on CPU)
            times.append(time.perf_counter() - t0[0])
            comm_s.append(trace.comm_seconds())
    train(model, opt, batch, a.steps + 1, on_step=on_step)   # the one loop: forward, backward, AdamW
    if world.rank == 0:
        print("RESULT " + json.dumps({"step": statistics.median(times), "comm": statistics.median(comm_s)}))


def launch(a, size, n, layout, threads):
    from pdist.testing import mpirun
    out = mpirun(n, __file__, "--worker", "--size", size, "--layout", layout, "--threads", threads,
                 "--steps", a.steps, "--dtype", a.dtype, timeout=600,
                 env={"PDIST_CHECK_COLLECTIVES": a.check})
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="lesson,wide")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--check", default="1", choices=["0", "1"],
                   help="PDIST_CHECK_COLLECTIVES (1, the default: one small extra all-reduce per collective)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", default="lesson", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="single", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    from pdist.course import lesson
    for size in a.sizes.split(","):
        if size not in SIZES:
            sys.exit(f"unknown size {size!r}; choose from {sorted(SIZES)}")
        res = {c[0]: [] for c in CONFIGS}
        for _ in range(a.repeats):
            for name, n, layout, threads in CONFIGS:
                res[name].append(launch(a, size, n, layout, threads))
        base = statistics.median(r["step"] for r in res[CONFIGS[0][0]])
        rows = []
        for name, n, layout, _ in CONFIGS:
            steps = [r["step"] for r in res[name]]
            med = statistics.median(steps)
            rows.append((name, f"{med * 1e3:.1f}", f"{max(steps) / min(steps):.2f}",
                         f"{statistics.median(r['comm'] for r in res[name]) * 1e3:.1f}" if n > 1 else "-",
                         f"{base / med:.2f}x"))
        kw, B = SIZES[size]
        print(f"\n{size}: {kw['n_layer']} layers, n_embd {kw['n_embd']}, T {kw['block_size']}, batch {B}, "
              f"{a.dtype}; {os.cpu_count()} cores; medians of {a.repeats} launches x {a.steps} steps")
        print(lesson.table(rows, ["run", "step ms", "spread", "in collectives ms", "vs 1 thread"]))
        from machine import report
        report(f"tensor_parallel_{size}", {"rows": rows, "runs": res})


if __name__ == "__main__":
    main()
