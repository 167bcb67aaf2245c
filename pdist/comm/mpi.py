"""MPI transport on mpi4py: start-up, BLAS threads per rank, cooperative waits,
and point-to-point over NumPy buffers (no pickling on any hot path).

Threads. ``setup()`` exchanges, over the node's split (``COMM_TYPE_SHARED``, one
``allgather``), each rank's CPU affinity mask and pid. A node whose L ranks may run on
the C cores of the union of those masks gives each rank ``max(1, C // L)`` BLAS threads
(threadpoolctl), at most the cores of its own mask; when the masks are disjoint (the
launcher bound each rank to its own cores: Open MPI's default at np <= 2, Intel MPI's
pinning, ``srun --cpu-bind``, ``--map-by slot:PE=n``) each rank takes the cores of its own
mask. Four ranks on two cores do not fight over the cores (measured here: two ranks with
two BLAS threads each ran a matmul loop 2.4x slower than with one each). A user's
``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/``MKL_NUM_THREADS`` always stands: it is
applied as given, even above the mask (OpenBLAS itself would cap it at the mask's size).

Cooperative waits. MPICH ranks that wait busy-poll: a rank blocked in
``Recv``/``Allreduce`` spins on a core at 100%. When ranks outnumber cores
(L > C, C the cores of the union of the node's masks: binding is not oversubscription)
those spinning ranks steal time from the ranks doing real work (4 ranks
on 2 cores with uneven work ran ~2x slower than ideal). In that case every
blocking operation is issued non-blocking and finished by ``wait_all``:
``Test()``, and while not done, yield the core (``sched_yield``) for up to
``PDIST_WAIT_YIELD_US`` (1000 us: short waits, e.g. a transfer in flight, stay
fast), then sleep with exponential backoff from 20 us up to 250 us (long waits,
e.g. for a slower pipeline stage, leave the core to the rank that computes).
Otherwise a waiting rank spins on ``Test()`` as MPI's own blocking calls would.
Override the choice with ``PDIST_COOPERATIVE_WAIT=0|1``.

Deadlines. In both modes operations are issued non-blocking and finished by
``wait_all``, not by a blocking MPI call (which could not be interrupted):
every ``PROBE_S`` (2 ms) the wait checks its deadline and the control channel
(watchdog.py), so a rank that waits for a peer that exited or failed, or past
``PDIST_TIMEOUT``, raises ``CollectiveTimeoutError``. The one blocking call
left is the data phase of a collective whose fingerprint check has just shown
every rank to be in it (``MPICollectives``).
"""
import os
import time

import mpi4py

mpi4py.rc.initialize = True
from mpi4py import MPI  # noqa: E402

from pdist.measure import trace  # noqa: E402
from pdist.comm import liveness, watchdog  # noqa: E402
from pdist.engine.env import env_number  # noqa: E402

_state = {"limits": None, "cooperative": None, "local_size": None, "cores": None, "node_cores": None,
          "disjoint": False, "node_pids": {}}

SEGMENT_BYTES = 1 << 19    # ring reduce-scatter pipelines reductions in 512 KiB pieces
YIELD_SECONDS = env_number("PDIST_WAIT_YIELD_US", 1000, "number of microseconds", 1000,
                           zero_ok=True) * 1e-6                                 # Test + yield phase
SLEEP_MIN, SLEEP_MAX = 20e-6, 250e-6
WAIT_SPAN_S = 50e-6
USER_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# seconds this process spent in polled waits that did not finish at once (pdist.faults.debug reads it
# around each phase of a step: the straggler detector's "waiting"); only the slow path adds to it
WAITED = [0.0]


def cores_available():
    """Cores this process may run on (affinity mask, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _mask():
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def _pid_namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover - no /proc
        return None


def node_exchange(comm=None):
    """Once: split ``comm`` by node and allgather each rank's (world rank, pid, pid namespace,
    CPU mask). Sets the local size, the union of the node's masks and the node's peers
    ({world rank: pid} of ranks that share this pid namespace, the ones ``os.kill(pid, 0)`` can
    probe: watchdog.py). Collective over ``comm``."""
    if _state["local_size"] is None:
        comm = comm or MPI.COMM_WORLD
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        me = (MPI.COMM_WORLD.Get_rank(), os.getpid(), _pid_namespace(), _mask())
        infos = node.allgather(me)
        node.Free()
        masks = [set(i[3]) for i in infos]
        union = set().union(*masks)
        _state.update(local_size=len(infos), node_cores=len(union),
                      disjoint=sum(map(len, masks)) == len(union),
                      node_pids={r: pid for r, pid, ns, _ in infos if ns == me[2] and r != me[0]})
        liveness.set_node_pids(_state["node_pids"])
    return _state["local_size"]


def local_size(comm=None):
    """Number of ranks sharing this node (size of the COMM_TYPE_SHARED split)."""
    return node_exchange(comm)


def node_cores(comm=None):
    """Cores that this node's ranks may run on: the union of their affinity masks."""
    node_exchange(comm)
    return _state["node_cores"]


def blas_threads(own, union, local, disjoint):
    """BLAS threads for a rank whose mask has ``own`` cores, on a node whose ``local`` ranks
    have masks of ``union`` cores in all (``disjoint``: no core in two masks)."""
    if disjoint:
        return max(1, own)
    return max(1, min(own, union // local))


def user_threads():
    """{user_api: n} of the user's explicit settings: "blas" from OPENBLAS_NUM_THREADS or
    MKL_NUM_THREADS (else OMP_NUM_THREADS), "openmp" from OMP_NUM_THREADS; only positive integers."""
    def num(var):
        val = os.environ.get(var, "").strip().split(",")[0]
        return int(val) if val.isdigit() and int(val) > 0 else None
    blas = num("OPENBLAS_NUM_THREADS") or num("MKL_NUM_THREADS") or num("OMP_NUM_THREADS")
    return {k: v for k, v in (("blas", blas), ("openmp", num("OMP_NUM_THREADS"))) if v}


def _limit_threads(threads):
    try:
        from threadpoolctl import threadpool_limits
        _state["limits"] = threadpool_limits(limits=threads)
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        pass


def setup(comm=None):
    """Once per process: BLAS threads from the node's masks (``blas_threads``) unless the user
    set OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS (then the user's number is
    applied as given); cooperative waits when the node's ranks outnumber the union of their
    cores. Collective over ``comm`` (the node exchange, and the agreement on the wait mode).
    Returns (threads, cooperative); threads is None when the user's setting stands."""
    if _state["cooperative"] is not None:
        return _state["limits_n"], _state["cooperative"]
    from pdist.engine.env import env_flag
    local = node_exchange(comm)
    cores = _state["node_cores"]
    threads = blas_threads(cores_available(), cores, local, _state["disjoint"])
    if any(os.environ.get(v, "").strip() for v in USER_THREAD_VARS):
        threads = None                     # the user's choice wins, and is not lowered
        if user_threads():                 # (OpenBLAS alone would cap it at this rank's mask)
            _limit_threads(user_threads())
    else:
        _limit_threads(threads)
    auto = os.environ.get("PDIST_COOPERATIVE_WAIT", "").strip() == ""
    coop = local > cores if auto else env_flag("PDIST_COOPERATIVE_WAIT", False)
    # every rank must wait the same way: a blocking collective never matches a
    # non-blocking one in MPI, and nodes may differ in cores or ranks per node
    coop = bool((comm or MPI.COMM_WORLD).allreduce(int(coop), op=MPI.MAX))
    _state.update(limits_n=threads, cooperative=coop, cores=cores)
    return threads, coop


def cooperative():
    """True when blocking waits yield the core (ranks on this node > cores)."""
    return bool(_state["cooperative"])


def set_cooperative(flag):
    """Force cooperative waits on or off (benchmarks compare the two)."""
    _state["cooperative"] = bool(flag)


def wait_all(reqs, statuses=None):
    """Finish MPI requests: Test until done (yield/sleep when cooperative, spin
    otherwise), checking the deadline and the control channel every PROBE_S."""
    if MPI.Request.Testall(reqs, statuses):
        return
    coop, now = _state["cooperative"], time.perf_counter
    t0 = now()
    watch, t_check = None, t0 + watchdog.PROBE_S
    sleep, t_yield = SLEEP_MIN, t0 + YIELD_SECONDS
    while not MPI.Request.Testall(reqs, statuses):
        t = now()
        if t >= t_check:
            watch = watch or watchdog.Watch(t0)
            watch.check(t)                 # raises CollectiveTimeoutError
            t_check = watch.next
        if not coop:
            continue
        if t < t_yield:
            os.sched_yield()
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, SLEEP_MAX)
    t1 = now()
    WAITED[0] += t1 - t0
    if trace.DETAIL[0] and t1 - t0 > WAIT_SPAN_S:   # a detailed trace shows waits > 50 us (cat "wait")
        trace.record("wait", "wait", t0, t1)


def contiguous_flat(a, what="buffer"):
    """A flat view of ``a`` (no copy). Raises if ``a`` is not C-contiguous."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (got strides {a.strides}); "
                         f"pass xp.ascontiguousarray(x)")
    return a.reshape(-1)


class MPIP2P:
    """Point-to-point over one MPI communicator, counting the bytes it sends.

    The hand-built algorithms (algorithms.py) use only ``send``, ``recv`` and
    ``sendrecv`` of this object (or of its NCCL twin), so they never know which
    transport moves their bytes. ``wire_bytes`` grows by every byte sent."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.wire_bytes = 0

    def send(self, buf, dst, tag=0):
        self.wire_bytes += buf.nbytes
        wait_all([self.comm.Isend(buf, dst, tag)])

    def recv(self, buf, src, tag=0):
        status = MPI.Status()
        wait_all([self.comm.Irecv(buf, src, tag)], [status])
        check_count(status, buf)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        """Send ``sendbuf`` to ``dst`` while receiving ``recvbuf`` from ``src``
        (both posted at once, so a ring of these never deadlocks)."""
        self.wire_bytes += sendbuf.nbytes
        wait_all([self.comm.Irecv(recvbuf, src, tag), self.comm.Isend(sendbuf, dst, tag)])

    def sendrecv_iter(self, sendbuf, dst, recvbuf, src, tag=0, segment_bytes=None):
        """``sendrecv`` in segments, all posted at once, yielding each received
        segment's (start, stop) as it lands, so the caller can reduce segment k
        while k+1.. are still in flight. Both sides must pass equal sizes and
        dtypes (they cut the same segments); consume the generator fully."""
        self.wire_bytes += sendbuf.nbytes

        def cut(buf):                        # sender and receiver cut a message alike
            step = max(1, (segment_bytes or SEGMENT_BYTES) // max(1, buf.itemsize))
            return [(a, min(a + step, buf.size)) for a in range(0, buf.size, step)]
        bounds = cut(recvbuf)
        recvs = [self.comm.Irecv(recvbuf[a:b], src, tag) for a, b in bounds]
        sends = [self.comm.Isend(sendbuf[a:b], dst, tag) for a, b in cut(sendbuf)]
        for ab, req in zip(bounds, recvs):
            wait_all([req])
            yield ab
        wait_all(sends)


def check_count(status, buf):
    """Raise when a receive got fewer elements than ``buf`` holds (a larger
    message already fails in MPI with a truncation error)."""
    got = status.Get_count(MPI.BYTE)
    if got != buf.nbytes:
        raise ValueError(f"recv: expected {buf.nbytes} bytes ({buf.size} x {buf.dtype}) "
                         f"from rank {status.Get_source()}, got {got} bytes; "
                         f"sender and receiver disagree on size or dtype")


__all__ = ["MPI", "setup", "cooperative", "set_cooperative", "wait_all", "contiguous_flat", "MPIP2P",
           "check_count", "cores_available", "local_size", "node_cores", "node_exchange", "blas_threads",
           "WAITED"]
