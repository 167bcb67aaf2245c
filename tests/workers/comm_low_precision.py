"""2-byte float collectives (pdist/comm/low_precision.py) against their definition.

    mpiexec -n 3 python tests/workers/comm_low_precision.py

Every rank knows every rank's input (seeded by rank), so it computes the expected
result itself: round(Σ_q fp32(x_q)) summed in rank order (÷ n for avg), or the max;
reduce to one rank gives that rank the all-reduce's bits and leaves the others' buffers;
all-gather and broadcast move the 16-bit words unchanged. Sizes not divisible by n
(the all-reduce pads; reduce_scatter's chunks are uneven), sync and async."""
import numpy as np

from pdist import comm
from pdist.comm.algorithms import chunk_bounds
from pdist.engine.precision import bfloat16
from pdist.testing import report

world = comm.init()
n, r = world.size, world.rank
checked = 0
for dt in (bfloat16, np.dtype(np.float16)):
    def data(q, size):
        return (np.random.default_rng(100 + q).standard_normal(size) * 3).astype(dt)

    def want(size, op):
        acc = data(0, size).astype(np.float32)
        for q in range(1, n):
            acc = np.maximum(acc, data(q, size).astype(np.float32)) if op == "max" else \
                acc + data(q, size).astype(np.float32)
        return (acc / n if op == "avg" else acc).astype(dt)

    for size in (1, 7, 64, 1001):
        for op in ("sum", "avg", "max"):
            for async_op in (False, True):
                buf = data(r, size)
                w = world.all_reduce(buf, op=op, async_op=async_op)
                if async_op:
                    w.wait()
                expect = want(size, op)
                assert buf.dtype == dt and np.array_equal(buf.view(np.uint16), expect.view(np.uint16)), \
                    (dt, size, op)
                checked += 1
        full = want(size, "avg")
        lo, hi = chunk_bounds(size, n)[r]
        out = np.empty(hi - lo, dtype=dt)
        world.reduce_scatter(out, data(r, size), op="avg")
        assert np.array_equal(out.view(np.uint16), full[lo:hi].view(np.uint16)), (dt, size, "reduce_scatter")
        g = np.empty(size, dtype=dt)
        world.all_gather(g, full[lo:hi].copy())
        assert np.array_equal(g.view(np.uint16), full.view(np.uint16)), (dt, size, "all_gather")
        b = data(r, size)
        world.broadcast(b, src=n - 1)
        assert np.array_equal(b.view(np.uint16), data(n - 1, size).view(np.uint16))
        for op in ("sum", "max"):                  # reduce to the last rank: only it changes
            red = data(r, size)
            world.reduce(red, dst=n - 1, op=op)
            keep = want(size, op) if r == n - 1 else data(r, size)
            assert np.array_equal(red.view(np.uint16), keep.view(np.uint16)), (dt, size, "reduce", op)
        checked += 5
world.reset_stats()
x = np.ones(1000, dtype=bfloat16)
world.all_reduce(x)
report(rank=r, checked=checked, all_reduce_bytes=world.stats["all_reduce"]["bytes"], sum=float(x[0]))
