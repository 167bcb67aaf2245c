"""Bad inputs end in a clear error on every rank, never a hang; the group stays
usable afterwards. Each case runs on all ranks and must raise the expected
exception type with the expected words on *every* rank."""
import numpy as np

from pdist import comm
from pdist.comm import CollectiveMismatchError
from pdist.testing import report


def expect(g, fn, exc, *words):
    try:
        fn()
    except exc as e:
        msg = str(e)
        for w in words:
            assert w in msg, f"{w!r} not in error message:\n{msg}"
        ok = 1
    else:
        ok = 0
    oks = g.all_gather_object(ok)
    assert all(oks), f"not every rank raised {exc.__name__} ({words}): {oks}"


def main():
    g = comm.init()
    n, r = g.size, g.rank
    last = n - 1
    # local errors: one rank's arguments are invalid -> every rank raises
    a, b = comm.chunk_bounds(10, n)[r]
    expect(g, lambda: g.reduce_scatter(np.empty(b - a + (2 if r == last else 0)), np.zeros(10)),
           CollectiveMismatchError, "reduce_scatter", "out.size")
    expect(g, lambda: g.all_gather(np.zeros(12), np.zeros(12 // n + (5 if r == 0 else 0))),
           CollectiveMismatchError, "all_gather", "inp.size")
    expect(g, lambda: g.all_reduce(np.arange(4), op="avg"), CollectiveMismatchError, "avg", "floating")
    expect(g, lambda: g.all_reduce(np.zeros((4, 4))[:, 1]), CollectiveMismatchError, "contiguous")
    expect(g, lambda: g.broadcast(np.zeros(3), src=n), CollectiveMismatchError, f"src={n}")
    expect(g, lambda: g.all_reduce(np.zeros(3), algorithm="tree"), ValueError, "algorithm")
    expect(g, lambda: g.all_reduce(np.zeros(3), op="prod"), ValueError, "op must be")
    expect(g, lambda: g.all_to_all(np.zeros(n + 1), np.zeros(n + 1)) if n > 1 else
           g.all_to_all(np.zeros(2), np.zeros(3)), CollectiveMismatchError, "all_to_all")
    if n > 1:
        # ranks disagree: sizes, dtypes, roots, ops, a skipped collective
        for alg in ("mpi", "ring", "naive"):
            expect(g, lambda: g.all_reduce(np.zeros(10 if r == 0 else 11), algorithm=alg),
                   CollectiveMismatchError, "all_reduce", "size", "rank 0", "size=10", "size=11")
        expect(g, lambda: g.all_reduce(np.zeros(8, np.float32 if r == 0 else np.float64)),
               CollectiveMismatchError, "dtype", "float32", "float64")
        expect(g, lambda: g.all_reduce(np.zeros(8, np.int32 if r == 0 else np.float32)),
               CollectiveMismatchError, "dtype")
        expect(g, lambda: g.reduce_scatter(np.empty(2), np.zeros(2 * n + (1 if r == last else 0))),
               CollectiveMismatchError, "reduce_scatter")
        expect(g, lambda: g.broadcast(np.zeros(4), src=r % 2), CollectiveMismatchError, "root")
        expect(g, lambda: g.all_reduce(np.zeros(4)) if r == 0 else g.broadcast(np.zeros(4)),
               CollectiveMismatchError, "op", "all_reduce", "broadcast")
        expect(g, lambda: g.all_reduce(np.zeros(4), algorithm="ring" if r == 0 else "mpi"),
               CollectiveMismatchError, "algorithm")
        def skip_barrier_on_rank0():
            if r != 0:
                g.barrier()                               # rank 0 skips the barrier ...
            g.all_reduce(np.zeros(4))                     # ... caught at its next collective
        expect(g, skip_barrier_on_rank0, CollectiveMismatchError, "barrier", "all_reduce")
        # point-to-point: receive size disagrees with the send
        if r == 0:
            g.send(np.zeros(5), 1, tag=3)
        elif r == 1:
            try:
                g.recv(np.zeros(8), 0, tag=3)
                raise AssertionError("short message not detected")
            except ValueError as e:
                assert "expected 64 bytes" in str(e) and "got 40" in str(e), e
        g.barrier()
    if n == 2:
        fused_pair(g, r)
    x = np.full(6, r + 1.0)                               # the group still works
    g.all_reduce(x)
    assert np.all(x == n * (n + 1) / 2)
    g.barrier()
    if n > 1:
        # async collectives check their arguments in wait() (issuing stays non-blocking):
        # a mismatch is raised there on every rank, before waiting on the data.
        # A split of its own, as the mismatched data operation is left behind.
        h = g.split(0, name="async-check")
        expect(h, lambda: h.all_reduce(np.zeros(10 if r == 0 else 11), async_op=True).wait(),
               CollectiveMismatchError, "all_reduce", "size=10", "size=11")
    report(rank=r, n=n, ok=True)


def fused_pair(g, r):
    """Two ranks: a small blocking all_reduce carries its check in the payload's message
    (pdist/comm/pair.py). Its bits equal MPI's Allreduce; a mismatch with any other call
    still raises on both ranks; so does a partner that did not fuse an equal call."""
    from mpi4py import MPI
    from pdist.comm import flight_recorder
    from pdist.comm.pair import SMALL_BYTES
    raw, rng = g.comm.Dup(), np.random.default_rng(7 + r)
    for dt in ("float32", "float64", "int32", "int64", "uint8"):
        for op in ("sum", "avg", "max", "min"):
            if op == "avg" and dt[0] != "f":
                continue
            x = (rng.standard_normal((3, 5)) * 100).astype(dt)
            want, xa = x.copy(), x.copy()
            raw.Allreduce(MPI.IN_PLACE, want, {"avg": MPI.SUM, "sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
            if op == "avg":
                want /= 2
            seq, st = g._seq, dict(g.stats.get("all_reduce", {"calls": 0, "bytes": 0}))
            g.all_reduce(x, op=op)
            assert np.array_equal(x, want), (dt, op, x, want)
            assert fused(g, x, op), "the small all_reduce was not fused"
            now = dict(g.stats["all_reduce"])                 # counted on the pair, folded in on read
            assert (now["calls"], now["bytes"]) == (st["calls"] + 1, st["bytes"] + x.nbytes), (st, now)
            last = flight_recorder.flight()[-1]
            assert (last["op"], last["seq"], last["state"], g._seq) == ("all_reduce", seq + 1, "done", seq + 1)
            w = g.all_reduce(xa, op=op, async_op=True)        # async: the payload rides on the check too
            assert len(w._keep) == 2 and w._keep[1].rbuf.nbytes == g._pair.rbuf.nbytes, "async call not fused"
            w.wait()
            assert np.array_equal(xa, want), ("async", dt, op, xa, want)
            assert fused(g, xa, op, True) and g.stats["all_reduce"]["calls"] == now["calls"] + 1
    in_flight(g, r)
    g.check, x = False, np.full(5, r + 1.0)                # checks off: the same one-message path
    try:
        g._pair.slots.clear()
        g.all_reduce(x)
        assert np.all(x == 3.0) and fused(g, x, "sum"), "checks-off call not fused"
    finally:
        g.check = True
    big = SMALL_BYTES // 8 + 1                              # float64 elements: just over the fused size
    expect(g, lambda: g.all_reduce(np.zeros(8 if r == 0 else big)), CollectiveMismatchError, "size=8",
           f"size={big}")
    expect(g, lambda: g.all_reduce(np.zeros(8), async_op=r == 1).wait() if r == 1 else g.all_reduce(np.zeros(8)),
           CollectiveMismatchError, "async_op")
    expect(g, lambda: g.all_reduce(np.zeros(8), op="max" if r == 0 else "sum"), CollectiveMismatchError,
           "reduce-op", "max", "sum")
    if r == 1:                                           # an equal call that does not fuse (a device array
        g._pair.fused = lambda *a, **k: None             # would not): both ranks refuse it
    expect(g, lambda: g.all_reduce(np.zeros(8)), CollectiveMismatchError, "carried its payload")
    if r == 1:
        del g._pair.fused


def fused(g, x, op, async_op=False):
    """The fused slot of this call (pair.py's cache), None if it was not fused."""
    return g._pair.slots.get((x.dtype, x.shape, x.strides, op, "mpi", async_op))


def in_flight(g, r):
    """Several small async all_reduces in flight (a DDP backward's buckets), a blocking call
    between them, waited on in reverse: each has a channel of its own (pair_async.py), the
    k-th receive gets the partner's k-th message, and a finished op's channel is reused. Then
    async calls of more than the fused size (their header on a channel, their data by MPI's
    Iallreduce), sum and avg, and mismatches of size and of async_op."""
    xs = [np.full(7, float(r + k)) for k in range(5)]
    ws = [g.all_reduce(x, async_op=True) for x in xs]
    y = np.full(3, float(r))
    g.all_reduce(y)
    chans = [w._keep[1] for w in ws]
    assert len({id(c) for c in chans}) == 5 and np.all(y == 1.0)
    for w in reversed(ws):
        w.wait()
    assert all(np.all(x == 2 * k + 1) for k, x in enumerate(xs)), xs
    x = np.full(7, float(r))
    w = g.all_reduce(x, async_op=True)
    assert any(w._keep[1] is c for c in chans), "a finished op's channel was not reused"
    while not w.is_completed():
        pass
    assert np.all(x == 1.0)
    expect(g, lambda: g.all_reduce(np.zeros(7 if r == 0 else 6), async_op=True).wait(), CollectiveMismatchError,
           "size=7", "size=6")
    w = g.all_reduce(x, async_op=True)
    w.wait()
    assert np.all(x == 2.0), "the channel after a mismatch"
    from mpi4py import MPI
    from pdist.comm.pair import SMALL_BYTES
    big = SMALL_BYTES // 8 + 1               # float64: more than the fused size, the header alone
    xs = [np.full(big, float(r + k)) for k in range(3)]
    ws = [g.all_reduce(x, op="avg" if k == 1 else "sum", async_op=True) for k, x in enumerate(xs)]
    chans = [w._keep[1] for w in ws]
    assert all(c.sview is None for c in chans)   # (a checked header's channel may serve the next call)
    for w in ws:
        w.wait()
    assert np.all(xs[0] == 1.0) and np.all(xs[1] == 1.5) and np.all(xs[2] == 5.0), [x[:2] for x in xs]
    w = g.all_reduce(xs[0], async_op=True)
    assert any(w._keep[1] is c for c in chans), "a big call's header channel was not reused"
    w.wait()
    assert np.all(xs[0] == 2.0)
    if "MPICH" in MPI.Get_library_version():  # an async call posts its data before its check passes:
        # Open MPI 5's mismatched Iallreduce aborts the process at exit, after both ranks raised
        # (docs/collectives.md); MPICH's does not
        expect(g, lambda: g.all_reduce(np.zeros(big if r == 0 else big + 1), async_op=True).wait(),
               CollectiveMismatchError, f"size={big}", f"size={big + 1}")
    expect(g, lambda: g.all_reduce(np.zeros(big), async_op=r == 0).wait() if r == 0 else g.all_reduce(np.zeros(big)),
           CollectiveMismatchError, "async_op")


if __name__ == "__main__":
    main()
