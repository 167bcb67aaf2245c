"""Every op x algorithm on the world (and, at 4 ranks, the sub-groups of a 2x2
mesh): sizes not divisible by n, zero-size and smaller-than-n buffers,
float32/float64/int64, async handles, point-to-point, accounting.

Each rank builds every member's input from a seed, computes the reference
locally with NumPy, and checks (1) its result against it (integers exactly,
floats to reduction-order tolerance), (2) that every rank holds the same bytes,
(3) integer results are bit-identical across algorithms."""
import os
import sys

import numpy as np

from pdist import comm
from pdist.measure import trace
from pdist.comm.mpi import cooperative
from pdist.testing import report

SIZES = [0, 1, 2, 7, 1001, 20003]
DTYPES = [np.float64, np.float32, np.int64]
TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 2e-5}


def data(world_rank, size, dtype, salt=0):
    rng = np.random.default_rng([world_rank, size, np.dtype(dtype).num, salt])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(size).astype(dtype)
    return rng.integers(-1000, 1000, size).astype(dtype)


def reduce_ref(arrs, op):
    stack = np.stack([a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrs])
    if op in ("sum", "avg"):
        out = stack.sum(0)
        out = out / len(arrs) if op == "avg" else out
    else:
        out = stack.max(0) if op == "max" else stack.min(0)
    return out


def close(got, ref, what):
    if got.dtype.kind == "f":
        ok = np.allclose(got, ref, rtol=TOL[got.dtype], atol=TOL[got.dtype] * 10)
    else:
        ok = np.array_equal(got, ref)
    assert ok, f"{what}: max err {np.max(np.abs(got - ref)) if got.size else 0}\n{got[:8]}\n{ref[:8]}"


def same_everywhere(g, x, what):
    blobs = g.all_gather_object(x.tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what}: ranks hold different results"


def check_group(g, label):
    n, r = g.size, g.rank
    results = {}
    for size in SIZES:
        for dt in DTYPES:
            ins = [data(w, size, dt) for w in g.ranks]                    # every member's input
            ops = ["sum", "max", "min"] + (["avg"] if np.dtype(dt).kind == "f" else [])
            for op in ops:
                ref = reduce_ref(ins, op)
                a, b = comm.chunk_bounds(size, n)[r]
                for alg in ("mpi", "naive", "ring"):
                    what = f"[{label}] {alg} op={op} size={size} {np.dtype(dt)}"
                    x = ins[r].copy()
                    g.all_reduce(x, op=op, algorithm=alg)
                    close(x, ref, "all_reduce " + what)
                    same_everywhere(g, x, "all_reduce " + what)
                    results.setdefault(("ar", size, dt, op), []).append(x)
                    out = np.full(b - a, 7, dt)
                    keep = ins[r].copy()
                    g.reduce_scatter(out, ins[r], op=op, algorithm=alg)
                    close(out, ref[a:b], "reduce_scatter " + what)
                    assert np.array_equal(keep, ins[r]), "reduce_scatter modified its input"
                    results.setdefault(("rs", size, dt, op), []).append(out)
                for alg in ("mpi", "naive", "tree"):
                    for root in sorted({0, n - 1}):
                        x = ins[r].copy()
                        g.reduce(x, dst=root, op=op, algorithm=alg)
                        close(x, ref if r == root else ins[r], f"reduce root={root} {alg} {op} {size} {dt}")
            full = np.concatenate([ins[q][slice(*comm.chunk_bounds(size, n)[q])] for q in range(n)])
            a, b = comm.chunk_bounds(size, n)[r]
            for alg in ("mpi", "naive", "ring"):
                out = np.zeros(size, dt)
                g.all_gather(out, ins[r][a:b].copy(), algorithm=alg)
                assert np.array_equal(out, full), f"[{label}] all_gather {alg} {size} {dt}"
            for alg in ("mpi", "naive", "tree"):
                for src in range(n):
                    x = ins[r].copy()
                    g.broadcast(x, src=src, algorithm=alg)
                    assert np.array_equal(x, ins[src]), f"[{label}] broadcast {alg} src={src} {size}"
    for key, outs in results.items():                                # ints: bitwise equal
        if key[2] == np.int64:
            assert all(np.array_equal(o, outs[0]) for o in outs), f"algorithms disagree on {key}"
    check_misc(g, label)


def check_segments(g, label):
    """Ring reduce-scatter pipelines its reduction in segments: cut them small
    so several segments (and a short last one) cross every step."""
    from pdist.comm import mpi
    r = g.rank
    old, mpi.SEGMENT_BYTES = mpi.SEGMENT_BYTES, 4096
    try:
        for size, dt in ((20003, np.float64), (5001, np.float32), (3, np.int64)):
            ins = [data(w, size, dt, salt=1) for w in g.ranks]
            ref = reduce_ref(ins, "sum")
            x = ins[r].copy()
            g.all_reduce(x, algorithm="ring")
            close(x, ref, f"[{label}] segmented ring all_reduce {size}")
            same_everywhere(g, x, "segmented ring")
    finally:
        mpi.SEGMENT_BYTES = old


def check_misc(g, label):
    n, r = g.size, g.rank
    check_segments(g, label)
    x = np.full((3, 5), g.ranks[r] + 1.0)                               # any shape, read flat
    g.all_reduce(x, algorithm="ring")
    assert x.shape == (3, 5) and np.all(x == sum(w + 1.0 for w in g.ranks))
    for alg in ("mpi", "naive", "ring"):                                # async handles
        x = data(g.ranks[r], 999, np.float64)
        ref = reduce_ref([data(w, 999, np.float64) for w in g.ranks], "avg")
        work = g.all_reduce(x, op="avg", algorithm=alg, async_op=True)
        while not work.is_completed():
            pass
        work.wait()
        close(x, ref, f"[{label}] async all_reduce {alg}")
    out = np.empty(comm.chunk_bounds(10, n)[r][1] - comm.chunk_bounds(10, n)[r][0])
    w1 = g.reduce_scatter(out, np.arange(10.0), async_op=True)
    full = np.empty(10)
    w1.wait()
    w2 = g.all_gather(full, out, async_op=True)
    b = np.full(4, float(r))
    w3 = g.broadcast(b, src=n - 1, async_op=True)
    w2.wait(), w3.wait()
    assert np.array_equal(full, np.arange(10.0) * n) and np.all(b == n - 1)
    parts = g.all_gather_list(np.full((2, 3), g.ranks[r], np.int64))
    assert [p.shape for p in parts] == [(2, 3)] * n and [int(p[0, 0]) for p in parts] == g.ranks
    inp = np.array([[100 * r + q, -(100 * r + q)] for q in range(n) for _ in range(3)], np.int64)
    for alg in ("mpi", "pairwise"):                                     # all_to_all
        out = np.empty_like(inp)
        g.all_to_all(out, inp, algorithm=alg)
        exp = np.array([[100 * q + r, -(100 * q + r)] for q in range(n) for _ in range(3)])
        assert np.array_equal(out, exp), f"[{label}] all_to_all {alg}"
    nxt, prv = (r + 1) % n, (r - 1) % n                                 # point-to-point ring
    a, b = np.full(5, r, np.int64), np.full(5, r, np.int64)
    msg = np.full(5, 10 * r, np.int64)
    ws = [g.isend(msg, nxt, tag=1), g.isend(msg + 1, nxt, tag=2)]
    g.recv(b, prv, tag=2)                                               # tags match out of order
    wr = g.irecv(a, prv, tag=1)
    wr.wait(), [w.wait() for w in ws]
    assert np.all(a == 10 * prv) and np.all(b == 10 * prv + 1)
    if n > 1:
        if r == 0:
            g.send(np.arange(3.0), 1, tag=5)
        elif r == 1:
            c = np.empty(3)
            g.recv(c, 0, tag=5)
            assert np.array_equal(c, np.arange(3.0))
    g.barrier()
    g.barrier(async_op=True).wait()
    check_stats(g, label)


def check_stats(g, label):
    n, r = g.size, g.rank
    g.reduce_scatter(np.empty(0), np.empty(0))                          # counted, 0 bytes
    g.reset_stats()
    S = 1200 * 8                                                        # 1200 divisible by 1..4
    for alg in ("mpi", "ring", "naive"):
        before = dict(g.stats.get("all_reduce", {"wire_bytes": 0}))
        g.all_reduce(np.ones(1200), algorithm=alg)
        wire = g.stats["all_reduce"]["wire_bytes"] - before["wire_bytes"]
        expect = {"mpi": 0, "ring": 2 * (n - 1) * S // n,
                  "naive": ((n - 1) * S if r == 0 else S) if n > 1 else 0}[alg]
        assert wire == expect, f"[{label}] {alg} wire bytes {wire} != {expect}"
    st = g.stats["all_reduce"]
    assert st["calls"] == 3 and st["bytes"] == 3 * (2 * (n - 1) * S // n), st
    g.all_gather(np.empty(1200), np.empty(1200 // n))
    g.reduce_scatter(np.empty(1200 // n), np.empty(1200))
    assert g.stats["all_gather"]["bytes"] == (n - 1) * S // n == g.stats["reduce_scatter"]["bytes"]
    assert g.bytes_sent() == sum(v["bytes"] for v in g.stats.values())
    g.reset_stats()
    assert g.stats == {} and g.bytes_sent() == 0


def main():
    if sys.argv[2:] == ["one-core"]:          # every rank on the same core: oversubscribed
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    world = comm.init()
    assert comm.init() is world and comm.get_world() is world
    assert world.name == "world" and world.ranks == list(range(world.size))
    expect_coop = sys.argv[1] if len(sys.argv) > 1 else None
    if expect_coop is not None:
        assert cooperative() == (expect_coop == "1"), f"cooperative()={cooperative()}, expected {expect_coop}"
    if sys.argv[2:] == ["one-core"]:          # the wait mode only: no collective spins on one core
        report(rank=world.rank, n=world.size, cooperative=cooperative(), ok=True)
        return
    trace.clear()
    check_group(world, "world")
    ops = {e["name"] for e in trace.events()}
    assert {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
            "recv", "isend", "irecv", "barrier"} | ({"send"} if world.size > 1 and world.rank == 0 else set()) <= ops, ops
    if world.size == 4:
        mesh = comm.DeviceMesh(dp=2, tp=2)
        check_group(mesh.dp_group, "dp")
        check_group(mesh.tp_group, "tp")
    world.barrier()
    report(rank=world.rank, n=world.size, cooperative=cooperative(), ok=True)


if __name__ == "__main__":
    main()
