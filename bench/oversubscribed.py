"""Uneven work with more ranks than cores: busy-polling vs cooperative waits.

    mpirun -n 4 python bench/oversubscribed.py        # on a 2-core machine

Two patterns, each run with MPI's busy-polling blocking waits and with pdist's
cooperative waits (Test + sched_yield, then sleeps of 20-250 us):

* allreduce: per step rank r computes w_r units, then a small all_reduce.
  Critical path: steps * max_r w_r units.
* pipeline: M microbatches flow rank 0 -> 1 -> ... -> n-1 (recv, compute w_r,
  send). Critical path: sum_r w_r + (M-1) max_r w_r units.

A unit of work is a fixed NumPy matmul loop (1 BLAS thread). The ideal is
max(all the work packed perfectly on the cores, the critical path): the first
is *measured* by running the same total work split evenly over ``cores`` ranks
at once, nobody waiting (two computations side by side run slower than one
alone on this machine); the second is the longest chain of units times one
unit's time alone. With ranks <= cores it also reports the latency
of an 8-byte all_reduce on both wait paths (cooperative mode must not be used
there, and is not by default).
"""
import argparse
import time

import numpy as np

from pdist import comm
from pdist.comm import mpi as M
from pdist.course.lesson import table

WORK = [3, 1, 3, 1]                 # units per rank (cycled for other world sizes)


def unit(a, reps):
    for _ in range(reps):
        a = np.tanh(a @ a * 1e-2)
    return a


def _timed(a, reps):
    t = time.perf_counter()
    unit(a, reps)
    return time.perf_counter() - t


def packed_time(g, a, reps, units, cores):
    """Wall time of ``units`` units of work spread perfectly over the cores with
    nobody waiting: ranks 0..cores-1 each run units/cores of them at the same
    time while the other ranks sleep. This is the ideal that keeps every core
    busy, measured, because two computations side by side can run slower than
    one alone (shared caches, memory bandwidth, SMT siblings, CPU quotas)."""
    M.set_cooperative(True)
    g.barrier()
    t = _timed(a, int(round(reps * units / cores))) if g.rank < cores else 0.0
    t = max(g.all_gather_object(t))
    g.barrier()
    return t


def _unit_time(g, a, reps):
    """Seconds per unit, timed on rank 0 while the others sleep (best of 3)."""
    M.set_cooperative(True)
    per = min(_timed(a, reps) for _ in range(3)) if g.rank == 0 else None
    per = g.broadcast_object(per)
    g.barrier()
    return per


def calibrate(g, a, target):
    M.set_cooperative(True)                         # others sleep while rank 0 times
    reps = per = None
    if g.rank == 0:
        one = min(_timed(a, 50) for _ in range(5)) / 50          # seconds per matmul rep
        reps = max(1, int(round(target / one)))
        per = min(_timed(a, reps) for _ in range(5))              # seconds per unit
    reps, per = g.broadcast_object((reps, per) if g.rank == 0 else None)
    g.barrier()
    return reps, per


def run_allreduce(g, a, reps, w, steps):
    x = np.zeros(1)
    g.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        unit(a, reps * w[g.rank])
        g.all_reduce(x)
    g.barrier()
    return time.perf_counter() - t


def run_pipeline(g, a, reps, w, micro):
    n, r = g.size, g.rank
    buf = np.zeros(16)
    g.barrier()
    t = time.perf_counter()
    for _ in range(micro):
        if r > 0:
            g.recv(buf, r - 1)
        unit(a, reps * w[r])
        if r < n - 1:
            g.send(buf, r + 1)
    g.barrier()
    return time.perf_counter() - t


def latency(g, iters=2000):
    x = np.zeros(1)
    for _ in range(100):
        g.all_reduce(x)
    t = time.perf_counter()
    for _ in range(iters):
        g.all_reduce(x)
    return (time.perf_counter() - t) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unit-ms", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    g = comm.init()
    n, cores = g.size, M.cores_available()
    g.check = False                                  # measure the waits, not validation
    w = [WORK[i % len(WORK)] for i in range(n)]
    a = np.random.default_rng(0).standard_normal((96, 96))
    reps, _ = calibrate(g, a, args.unit_ms / 1e3)
    ratios = {m: {"allreduce": [], "pipeline": []} for m in ("busy-poll", "cooperative")}
    times = {m: {"allreduce": [], "pipeline": []} for m in ("busy-poll", "cooperative")}
    for _ in range(args.repeats):            # re-time the unit each repeat: the machine may be shared
        c = min(cores, n)
        per = _unit_time(g, a, reps)                 # one unit alone: the critical-path bound
        packed = packed_time(g, a, reps, args.steps * sum(w), c)
        ideal = {"allreduce": max(packed, args.steps * max(w) * per),
                 "pipeline": max(packed, (sum(w) + (args.steps - 1) * max(w)) * per)}
        for mode in ("busy-poll", "cooperative"):
            M.set_cooperative(mode == "cooperative")
            for pat, fn in (("allreduce", run_allreduce), ("pipeline", run_pipeline)):
                t = fn(g, a, reps, w, args.steps)
                times[mode][pat].append(t)
                ratios[mode][pat].append(t / ideal[pat])
    med = lambda v: float(np.median(v))                                   # noqa: E731
    rows = [[m, med(times[m]["allreduce"]), med(ratios[m]["allreduce"]),
             med(times[m]["pipeline"]), med(ratios[m]["pipeline"])] for m in times]
    lat = None
    if n <= cores:
        lat = []
        for mode in ("fast path", "cooperative"):
            M.set_cooperative(mode == "cooperative")
            lat.append([mode, latency(g) * 1e6])
    if g.rank == 0:
        print(f"{n} ranks on {cores} cores; work units per rank {w}; unit ~ {args.unit_ms} ms "
              f"(ideal re-measured each repeat); {args.steps} steps / microbatches; median of {args.repeats}\n")
        print(table(rows, ["waits", "allreduce s", "x ideal", "pipeline s", "x ideal"], floatfmt="{:.3f}"))
        if lat:
            print("\n8-byte all_reduce latency (not oversubscribed):")
            print(table(lat, ["waits", "us / call"], floatfmt="{:.1f}"))
        from machine import report
        report("oversubscribed", {"ranks": n, "cores": cores, "rows": rows, "latency": lat})


if __name__ == "__main__":
    main()
