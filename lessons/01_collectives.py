"""Lesson 01: collectives, by hand and by MPI.

    python lessons/01_collectives.py            # 1 rank
    mpirun -n 4 python lessons/01_collectives.py

1. What each collective does, on small rank-labelled arrays (rank r holds
   10r + [0, 1, ...], one more element than ranks, so chunks are uneven).
2. The bus bandwidth of all-reduce for the naive, ring and MPI algorithms
   (nccl-tests: algbw = S / t, busbw = algbw * 2(n-1)/n, which is the link
   speed a bandwidth-optimal algorithm would need), and the bytes each
   algorithm really sent per rank against the ring's lower bound 2(n-1)/n * S.
   naive (reduce to rank 0, then rank 0 sends to all) puts (n-1)S on rank 0's
   link; the ring spreads 2(n-1)/n S evenly.
Check: every algorithm's result (all_reduce, reduce_scatter, all_gather,
broadcast) equals the reference each rank computes locally from the seeds.
"""
import time

import numpy as np

from pdist import comm
from pdist.course import lesson
from pdist.comm import chunk_bounds

ALGS = {"all_reduce": ("naive", "ring", "mpi"), "reduce_scatter": ("naive", "ring", "mpi"),
        "all_gather": ("naive", "ring", "mpi"), "broadcast": ("naive", "tree", "mpi")}


def show(g, title, arr):
    """Print every rank's array on rank 0, in rank order."""
    rows = g.all_gather_object(np.asarray(arr).tolist())
    if g.rank == 0:
        print(f"  {title}")
        for r, v in enumerate(rows):
            print(f"    rank {r}: {v}")


def demo(g):
    n, r = g.size, g.rank
    k = n + 1
    x = 10 * r + np.arange(k)
    if r == 0:
        print(f"== 1. what each collective does ({n} rank(s), {k} elements each) ==")
    show(g, "input", x)
    y = x.copy(); g.all_reduce(y)                                         # noqa: E702
    show(g, "all_reduce(sum): every rank gets the elementwise sum", y)
    a, b = chunk_bounds(k, n)[r]
    out = np.empty(b - a, x.dtype); g.reduce_scatter(out, x)              # noqa: E702
    show(g, f"reduce_scatter: rank r gets chunk r of the sum (chunks {chunk_bounds(k, n)})", out)
    full = np.empty(k, x.dtype); g.all_gather(full, x[a:b].copy())        # noqa: E702
    show(g, "all_gather: rank q sends chunk q of its input; every rank gets all n chunks in rank order", full)
    y = x.copy(); g.broadcast(y, src=n - 1)                               # noqa: E702
    show(g, f"broadcast(src={n - 1}): everyone gets rank {n - 1}'s array", y)
    y = x.copy(); g.reduce(y, dst=0)                                      # noqa: E702
    show(g, "reduce(dst=0): the sum on rank 0, others unchanged", y)
    t = np.repeat(10 * r + np.arange(n), 2)
    out = np.empty_like(t); g.all_to_all(out, t)                          # noqa: E702
    show(g, "all_to_all: chunk q of rank r's input goes to rank q (a transpose)", out)


def check_all(g, seed, dtype):
    """True if every algorithm matches the local reference for every op."""
    n, r = g.size, g.rank
    ok = True
    for size in (0, 3, 1001):
        ins = [np.random.default_rng([seed, q, size]).standard_normal(size).astype(dtype) for q in range(n)]
        ref = np.sum(np.stack(ins).astype(np.float64), 0) if size else np.zeros(0)
        tol = 1e-12 if dtype == "float64" else 1e-5
        a, b = chunk_bounds(size, n)[r]
        for alg in ALGS["all_reduce"]:
            x = ins[r].copy(); g.all_reduce(x, algorithm=alg)             # noqa: E702
            out = np.empty(b - a, dtype); g.reduce_scatter(out, ins[r], algorithm=alg)  # noqa: E702
            full = np.empty(size, dtype); g.all_gather(full, ins[r][a:b].copy(), algorithm=alg)  # noqa: E702
            gathered = np.concatenate([ins[q][slice(*chunk_bounds(size, n)[q])] for q in range(n)])
            ok &= np.allclose(x, ref, rtol=tol, atol=tol) and np.allclose(out, ref[a:b], rtol=tol, atol=tol)
            ok &= np.array_equal(full, gathered)
        for alg in ALGS["broadcast"]:
            x = ins[r].copy(); g.broadcast(x, src=n - 1, algorithm=alg)   # noqa: E702
            ok &= np.array_equal(x, ins[n - 1])
    return bool(ok)


def bandwidth(g, sizes, iters, dtype):
    n = g.size
    rows, runs = [], []
    for nbytes in sizes:
        x = np.ones(nbytes // np.dtype(dtype).itemsize, dtype)
        S = x.nbytes
        theory = 2 * (n - 1) * S // n
        for alg in ALGS["all_reduce"]:
            g.all_reduce(x, algorithm=alg)                                # warm-up
            g.reset_stats()
            g.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                g.all_reduce(x, algorithm=alg)
            dt = max(g.all_gather_object(time.perf_counter() - t)) / iters
            wire = g.all_gather_object(g.stats["all_reduce"]["wire_bytes"] // iters)
            algbw = S / dt / 1e9
            busbw = algbw * 2 * (n - 1) / n
            wire_cell = "inside MPI" if alg == "mpi" else f"{min(wire)} / {max(wire)}"
            rows.append([lesson.fmt_bytes(S), alg, dt * 1e3, algbw, busbw, wire_cell, theory])
            runs.append({"name": f"all_reduce_{alg}", "algorithm": alg, "bytes": S, "seconds": dt,
                         "algbw_GBps": algbw, "busbw_GBps": busbw, "theory_bytes_per_rank": theory,
                         "comm_bytes_per_step": g.all_gather_object(g.bytes_sent() // iters),
                         "wire_bytes_per_rank": None if alg == "mpi" else wire})
    return rows, runs


def parse_sizes_kib(p, text):
    """--sizes-kib "64,1024": bytes per size; anything but positive integers is a usage error."""
    try:
        kib = [int(s) for s in text.split(",")]
    except ValueError:
        kib = []
    if not kib or min(kib) < 1:
        p.error(f"--sizes-kib must be comma-separated integers >= 1, got {text!r}")
    return [k * 1024 for k in kib]


def main():
    p = lesson.parser(__doc__, steps=5, dtype="float64", no_inject=(
        "lesson 01 times collectives and trains nothing, and faults fire at training steps; "
        "faults start with lesson 02, e.g. mpirun -n 2 python lessons/02_data_parallel.py --inject nan:rank=1,step=3"))
    p.add_argument("--sizes-kib", default="64,1024,4096", help="all-reduce sizes for the table")
    args = lesson.validate(p, p.parse_args())  # on every rank, before any collective
    sizes = parse_sizes_kib(p, args.sizes_kib)
    g = comm.init(timeout=lesson.TIMEOUT)
    lesson.warn_shared_cores(g)
    demo(g)
    passed = check_all(g, args.seed, args.dtype)
    passed = all(g.all_gather_object(passed))
    rows, runs = bandwidth(g, sizes, args.steps, args.dtype)
    if g.rank == 0:
        n = g.size
        print(f"\n== 2. all-reduce bandwidth on {n} rank(s), {args.dtype}, mean of {args.steps} ==")
        print("busbw = algbw * 2(n-1)/n (nccl-tests); sent = bytes the least / most busy rank "
              f"sent per call; ring theory 2(n-1)/n*S{' (0 on one rank)' if n == 1 else ''}")
        print(lesson.table(rows, ["size", "algorithm", "ms", "algbw GB/s", "busbw GB/s",
                                  "sent min / max", "theory B"], floatfmt="{:.3f}"))
        print()
    lesson.finish("01_collectives", passed, runs, args, rank=g.rank, world_size=g.size,
                  detail=f"(every algorithm equals the local reference on {g.size} rank(s))")


if __name__ == "__main__":
    main()
