"""A mismatched or stuck NCCL call never hangs the host (strict CuPy stand-in, lazy streams,
the first NCCL call stalled: STRICT_CUPY_NCCL_STALL=1, PDIST_TIMEOUT short).

An async all-reduce whose size differs between the ranks raises CollectiveMismatchError
on every rank before anything is queued on NCCL (a mismatched kernel would hang the GPU).
Then an all-reduce is queued and the compute stream ordered after it; the read of its result
waits on an event under the watchdog's deadline, which passes: every NCCL communicator is
aborted and CollectiveTimeoutError raised on every rank (on a GPU the copy would block
forever). Prints OK on every rank."""
import cupy
from cupy.cuda import nccl
from pdist import comm
from pdist.comm.check import CollectiveMismatchError
from pdist.comm.watchdog import CollectiveTimeoutError
from pdist.engine.backend import to_numpy

g = comm.init()
try:
    g.all_reduce(cupy.ones(4 + g.rank), async_op=True)
except CollectiveMismatchError as e:
    assert "size=4" in str(e) and "size=5" in str(e), e
else:
    raise SystemExit("a mismatched async all-reduce was queued on NCCL")
x = cupy.ones(4)
g.all_reduce(x)                     # queued; it never completes
try:
    to_numpy(x)
except CollectiveTimeoutError as e:
    assert "communicators aborted" in str(e) and "roll-call" in str(e), e
    assert nccl._STATS["aborted"] == [tuple(range(g.size))], nccl._STATS
else:
    raise SystemExit("the read of a stuck all-reduce returned")
print(f"OK rank {g.rank} aborted", flush=True)
