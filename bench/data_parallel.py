"""Data-parallel throughput: 2 ranks vs 1 rank on a compute-bound GPT, and naive vs
bucketed gradient all-reduce, side by side in one run.

    python bench/data_parallel.py                     # 3 interleaved repeats, float32
    python bench/data_parallel.py --repeats 5 --steps 8

Every configuration trains a float32 GPT with AdamW for ``--steps`` timed steps after
2 warm-up steps, launched with mpiexec by this script (``--worker`` mode):

* "large" (4 layers, 8 heads, n_embd 256, T 64, 8 rows per rank): compute-bound,
  ~100 ms of BLAS per step against 12 MiB of gradients;
* "lesson" (the lessons' GPT, 2 layers, n_embd 64, T 32, 8 rows per rank): a few ms
  of compute per step, so the all-reduce's share -- and naive vs bucketed -- shows.

Per-rank work is fixed (weak scaling: 2 ranks train a global batch twice as large):

    throughput = ranks * rows * T / step time,   speedup = throughput / 1-rank, 1-thread throughput

Configurations: 1 rank with 1 BLAS thread (one core: the scaling baseline), 1 rank
with 2 BLAS threads (both cores, one process), and 2 ranks with 1 BLAS thread each
using DataParallelNaive, or DataParallel with PyTorch's default buckets (25 MiB,
first 1 MiB) or smaller ones, all trained by the one loop (pdist.training.train).
"wait ms" is the time the gradient synchronization after backward blocked
(``last_wait_seconds``): communication that backward did not hide. Waits busy-poll (2 ranks on 2
cores, PDIST_COOPERATIVE_WAIT=0). Repeats are interleaved so that load from other
processes hits every configuration alike; the table reports the median over repeats
of each run's median step, the best repeat ("best ms", and the speedup computed
from best repeats), and the spread (max/min over repeats) as a noise gauge.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODELS = {"large": (dict(block_size=64, n_layer=4, n_head=8, n_embd=256), 8),   # (GPT sizes, rows per rank)
          "lesson": (dict(block_size=32, n_layer=2, n_head=4, n_embd=64), 8)}
CONFIGS = [  # (model, label, ranks, BLAS threads per rank, kind, bucket MiB)
    ("large", "1 rank, 1 thread", 1, 1, "single", 0),
    ("large", "1 rank, 2 threads", 1, 2, "single", 0),
    ("large", "2 ranks, naive", 2, 1, "naive", 0),
    ("large", "2 ranks, bucketed 25 MiB", 2, 1, "bucketed", 25),
    ("large", "2 ranks, bucketed 2 MiB", 2, 1, "bucketed", 2),
    ("lesson", "1 rank, 1 thread", 1, 1, "single", 0),
    ("lesson", "2 ranks, naive", 2, 1, "naive", 0),
    ("lesson", "2 ranks, bucketed 0.0625 MiB", 2, 1, "bucketed", 0.0625),
]


def worker(a):
    from threadpoolctl import threadpool_limits

    from pdist import comm, data
    from pdist.models import gpt
    from pdist.course import lesson
    from pdist.measure import sync_wait, trace
    from pdist.engine.backend import synchronize
    from pdist.parallel import DataParallel, DataParallelNaive, Local
    from pdist.training import train

    world = comm.init()
    threadpool_limits(limits=a.threads)
    trace.disable()
    tokens, tok = data.char_dataset()
    cfg = lesson.gpt_config(tok.vocab_size, dtype="float32", **MODELS[a.model][0])
    model = Local(gpt.GPT(cfg, seed=0))
    if a.kind == "naive":
        model = DataParallelNaive(model, world)
    elif a.kind == "bucketed":
        model = DataParallel(model, world, bucket_cap_mb=a.bucket_mb, first_bucket_cap_mb=min(1, a.bucket_mb))
    opt = lesson.make_adamw(model.parameters())
    times, waits, clock = [], [], [0.0]

    def batch(step):       # the timed step starts after the batch is built and the ranks are lined up
        b = data.get_batch(tokens, a.rows * world.size, cfg.block_size, 0, step)   # (rows * ranks, T)
        world.barrier()
        clock[0] = trace.now()
        return b

    def on_step(step, loss):
        if step >= 2:
            synchronize()  # the step's device work is done (no-op on CPU)
            times.append(trace.now() - clock[0])
            waits.append(model.last_wait_seconds)

    with sync_wait.record():   # model.last_wait_seconds: each step's grad_sync, the wait backward did not hide
        train(model, opt, batch, 2 + a.steps, on_step=on_step)
    sync = bucket_sync(model, world) if a.kind == "bucketed" else []
    if world.rank == 0:
        print("RESULT " + json.dumps({"step": statistics.median(times), "wait": statistics.median(waits),
                                      "params": model.module.num_parameters(), "sync": sync}))


def bucket_sync(model, world, loops=15, iters=4):
    """[(bucket bytes, DDP's sync s, raw MPI s)] for each bucket of the trained model: DDP's
    own call on the bucket's buffer (``DataParallel._issue``'s all_reduce(op=sync_op(bucket),
    async_op=True), then ``wait()``: the fingerprint check, the transfer, and with op "avg" the
    1/n pass; at n = 2^k the hook scaled the gradients during backward and the op is "sum")
    against mpi4py's ``Allreduce`` of a buffer of the same size and dtype, interleaved, each
    the best of ``loops`` loops of ``iters`` calls (the slowest rank's time)."""
    import numpy as np
    from mpi4py import MPI

    from pdist.measure import trace
    raw, out = MPI.COMM_WORLD.Dup(), []

    def timed(fn):
        world.comm.Barrier()
        t = trace.now()
        for _ in range(iters):
            fn()
        return max(world.comm.allgather(trace.now() - t)) / iters

    for b in model.buckets:
        buf, other = b.buffer, np.zeros_like(b.buffer)
        op = model.sync_op(b)
        ms = {"ddp": lambda: world.all_reduce(buf, op=op, async_op=True).wait(),
              "raw": lambda: raw.Allreduce(MPI.IN_PLACE, other, MPI.SUM)}
        for fn in ms.values():
            fn()                                                   # warm-up
        best = dict.fromkeys(ms, float("inf"))
        for _ in range(loops):
            for k, fn in ms.items():
                best[k] = min(best[k], timed(fn))
        out.append((int(buf.nbytes), best["ddp"], best["raw"]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="single", help=argparse.SUPPRESS)
    p.add_argument("--model", default="large", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--bucket-mb", type=float, default=25, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    from pdist.course.lesson import table
    from pdist.testing import mpirun
    res = {c[:2]: [] for c in CONFIGS}
    params = {}
    for rep in range(a.repeats):
        for model, label, ranks, threads, kind, mb in CONFIGS:
            out = mpirun(ranks, __file__, "--worker", "--model", model, "--kind", kind, "--threads", threads,
                         "--bucket-mb", mb, "--steps", a.steps, "--rows", MODELS[model][1], timeout=600,
                         env={"PDIST_COOPERATIVE_WAIT": "0"})
            r = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
            res[model, label].append(r)
            params[model] = r["params"]
            print(f"  repeat {rep}: {model} {label}: {r['step'] * 1e3:.1f} ms/step", file=sys.stderr)
    for model, (sizes, rows_per_rank) in MODELS.items():
        T, base, base_best, rows = sizes["block_size"], None, None, []
        for m, label, ranks, *_ in CONFIGS:
            if m != model:
                continue
            steps = [r["step"] for r in res[m, label]]
            step = statistics.median(steps)
            wait = statistics.median(r["wait"] for r in res[m, label])
            tput, best = ranks * rows_per_rank * T / step, ranks * rows_per_rank * T / min(steps)
            base, base_best = base or tput, base_best or best
            rows.append((label, f"{step * 1e3:.1f}", f"{min(steps) * 1e3:.1f}",
                         f"{wait * 1e3:.2f}" if ranks > 1 else "-", f"{tput:,.0f}", f"{tput / base:.2f}x",
                         f"{best / base_best:.2f}x", f"{max(steps) / min(steps):.2f}"))
        print(f"\n{model} GPT: {sizes['n_layer']} layers, n_embd {sizes['n_embd']}, T {T}, "
              f"Psi = {params[model]:,} (float32, {params[model] * 4 / 2**20:.2f} MiB of gradients); "
              f"{rows_per_rank} rows per rank; "
              f"medians of {a.repeats} repeats x {a.steps} steps; {os.cpu_count()} cores")
        print(table(rows, ["configuration", "step ms", "best ms", "wait ms", "tokens/s", "speedup",
                           "speedup (best)", "spread"]))
        sync = sync_table(res, model, a.repeats)
        if sync:
            print(sync)
        from machine import report
        report(f"data_parallel_{model}", {"rows": rows, "sync": sync,
                                          "runs": {lb: res[m, lb] for m, lb, *_ in CONFIGS if m == model}})


def sync_table(res, model, repeats):
    """DDP's bucket sync against raw MPI at each bucket's size, from the bucketed runs: busbw
    = S/t * 2(n-1)/n (n = 2 ranks), the median over repeats of each run's best loop."""
    rows = []
    for m, label, ranks, _, kind, _ in CONFIGS:
        if m != model or kind != "bucketed":
            continue
        runs = [r["sync"] for r in res[m, label]]
        for i, (nbytes, _, _) in enumerate(runs[0]):
            ddp = statistics.median(r[i][1] for r in runs)
            raw = statistics.median(r[i][2] for r in runs)
            bus = 2 * (ranks - 1) / ranks * nbytes / 1e9
            rows.append((label, i, f"{nbytes / 2**10:.1f}", f"{ddp * 1e3:.3f}", f"{raw * 1e3:.3f}",
                         f"{bus / ddp:.2f}", f"{bus / raw:.2f}", f"{raw / ddp:.2f}"))
    if not rows:
        return ""
    from pdist.course.lesson import table
    return (f"\nDDP's bucket sync in the trained model vs raw MPI Allreduce of the same size (median of "
            f"{repeats} runs, each the best of 15 loops x 4 calls):\n"
            + table(rows, ["configuration", "bucket", "KiB", "ddp ms", "raw ms", "ddp busbw GB/s",
                           "raw busbw GB/s", "ddp/raw"]))


if __name__ == "__main__":
    main()
