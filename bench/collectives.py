"""All-reduce bus bandwidth: MPI vs ring vs naive, pdist vs raw mpi4py, memcpy.

    mpirun -n 2 python bench/collectives.py
    mpirun -n 4 python bench/collectives.py --sizes-mib 1,4,16,64

nccl-tests definitions: algbw = S / t, busbw = algbw * 2(n-1)/n (the bytes a
bandwidth-optimal all-reduce moves over each rank's link, per second).
Columns, in-place float32 sum, S bytes per rank:

* raw      mpi4py ``comm.Allreduce(MPI.IN_PLACE, x)``, nothing else
* raw+fp   raw preceded by a raw 176-byte MAX all-reduce: the floor of a checked call
           whose check is its own all-reduce (check.py, groups of n > 2), so "mpi/(raw+fp)"
           is the overhead pdist's Python adds over MPI's two calls there
* mpi      ``pg.all_reduce(x, algorithm="mpi")`` (checks on, the default); at n = 2 a
           payload of <= 64 KiB carries its check in one message each way (pair.py), so
           "mpi/raw" is the whole price of a checked call
* mpi-nochk  the same with ``PDIST_CHECK_COLLECTIVES=0`` behaviour
* ddp-sync ``pg.all_reduce(x, async_op=True).wait()``: DDP's sync of a bucket that backward
           overlaps (pdist.parallel.data_parallel: op "sum", as at n = 2^k DDP's hook has
           already scaled each gradient by 1/n during backward); "ddp/raw" its bus
           bandwidth over raw MPI's at the same size
* ring / naive  the hand-built algorithms (algorithms.py)
* memcpy   one core's ``np.copyto`` bandwidth (S / t): the physical reference,
           since on one node every byte moved is a memory copy

Each cell is the best of ``--repeats`` timed loops (methods interleaved, so
load from other processes hits them alike), each loop's time being the
slowest rank's. A second table gives small-message latency, where the cost of
the collective check shows (n > 2: one 176-byte all-reduce; n = 2: an 88-byte header,
on the payload's own message up to 64 KiB).
"""
import argparse
import time

import numpy as np

from pdist import comm
from pdist.comm.mpi import MPI, cooperative, cores_available
from pdist.course.lesson import table


def timed(g, fn, iters):
    g.comm.Barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return max(g.comm.allgather(time.perf_counter() - t)) / iters


def methods(g, raw, x):
    def nochk():
        g.check = False
        try:
            g.all_reduce(x, algorithm="mpi")
        finally:
            g.check = True
    fp = np.zeros(22, np.int64)           # the collective check's message: [f, -f], MAX
    return {"raw": lambda: raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
            "raw+fp": lambda: raw.Allreduce(MPI.IN_PLACE, fp, MPI.MAX) or raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
            "mpi": lambda: g.all_reduce(x, algorithm="mpi"),
            "ddp-sync": lambda: g.all_reduce(x, async_op=True).wait(),
            "mpi-nochk": nochk,
            "ring": lambda: g.all_reduce(x, algorithm="ring"),
            "naive": lambda: g.all_reduce(x, algorithm="naive")}


def memcpy_bw(nbytes, repeats=5):
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    np.copyto(dst, src)
    best = min(_t(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _t(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bandwidth_table(g, raw, sizes_mib, repeats):
    n = g.size
    rows = []
    for mib in sizes_mib:
        x = np.zeros(int(mib * (1 << 20)) // 4, np.float32)   # zeros: repeated in-place sums stay finite
        iters = max(2, min(20, int(64 // mib)))
        ms = methods(g, raw, x)
        for fn in ms.values():
            fn()                                                      # warm-up
        best = {k: float("inf") for k in ms}
        for _ in range(repeats):
            for k, fn in ms.items():
                best[k] = min(best[k], timed(g, fn, iters))
        bus = {k: x.nbytes / t / 1e9 * (2 * (n - 1) / n if n > 1 else 1) for k, t in best.items()}   # 1 rank: algbw
        mem = g.comm.bcast(memcpy_bw(x.nbytes) if g.rank == 0 else None)
        rows.append([f"{mib:g} MiB", *(bus[k] for k in ms), mem, bus["ring"] / bus["raw"],
                     best["raw"] / best["mpi"], best["raw"] / best["mpi-nochk"], best["raw"] / best["ddp-sync"]])
    heads = ["size", *(f"{k} busbw" for k in ms), "memcpy GB/s", "ring/raw", "mpi/raw", "nochk/raw", "ddp/raw"]
    return table(rows, heads, floatfmt="{:.2f}")


def latency_table(g, raw, repeats, calls=20):
    """Best of ``repeats`` short loops (``calls`` calls) per method, interleaved: on a loaded machine a
    short loop can run while both ranks hold a core, and the best one shows the call's cost."""
    rows = []
    for nbytes in (8, 1024, 65536):
        x = np.zeros(max(1, nbytes // 4), np.float32)
        ms = methods(g, raw, x)
        best = {k: float("inf") for k in ms}
        for _ in range(repeats):
            for k, fn in ms.items():
                best[k] = min(best[k], timed(g, fn, calls))
        rows.append([f"{nbytes} B", *(best[k] * 1e6 for k in ms), best["mpi"] / best["raw"],
                     best["mpi"] / best["raw+fp"]])
    return table(rows, ["size", *(f"{k} us" for k in methods(g, raw, np.ones(1))), "mpi/raw", "mpi/(raw+fp)"],
                 floatfmt="{:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="1,4,16,25,64", help="all-reduce sizes in MiB (25: DDP's "
                   "default bucket, bucket_cap_mb=25; 1: its first bucket)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-latency", action="store_true")
    p.add_argument("--latency-repeats", type=int, default=50, help="short loops per method and size")
    p.add_argument("--latency-calls", type=int, default=20, help="calls per short loop")
    args = p.parse_args()
    g = comm.init()
    raw = MPI.COMM_WORLD.Dup()
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    bw = bandwidth_table(g, raw, sizes, args.repeats)
    lat = None if args.no_latency else latency_table(g, raw, args.latency_repeats, args.latency_calls)
    if g.rank == 0:
        print(f"all-reduce, {g.size} ranks on {cores_available()} cores, float32 sum in place, "
              f"cooperative waits {'on' if cooperative() else 'off'}, best of {args.repeats}")
        print("busbw GB/s = S/t * 2(n-1)/n\n")
        print(bw)
        if lat:
            print("\nlatency (us per call):")
            print(lat)
        from machine import report
        report("collectives", {"ranks": g.size, "cooperative": cooperative(), "bandwidth": bw,
                               "latency": lat})


if __name__ == "__main__":
    main()
