"""ProcessGroup: the collective API every strategy calls, with accounting.

Arrays are of the active backend (NumPy or CuPy), C-contiguous, any shape
(read flat); results land in place / in ``out``. A call returns ``None``, or a
``Work`` (``wait()``, ``is_completed()``) with ``async_op=True``. The group picks
the transport from the array: NumPy -> MPI (mpi.py), CuPy -> NCCL (nccl.py),
so strategy code never branches on either.

The calls are mixed in: the collectives (their argument checks, the bytes each
is accounted, the algorithms each offers) from collectives.py, send/recv from
point_to_point.py, pickled objects from objects.py. ``_run`` here is the one
path every collective takes: settle, fingerprint, flight recorder, trace, count.

Safety (docs/failures.md): every call is fingerprinted (check.py) and recorded
in the flight recorder, every wait has a deadline (watchdog.py), and an async
op's buffers are held until it is waited on (work.py). Before a new
collective the group settles earlier async ops: it finishes their fingerprint
checks (so a mismatch is raised on every rank in the same order; before another
async op, only the checks already complete) and reports any whose handle was
dropped without ``wait()``.
"""
import numpy as np

from pdist.measure import blocked, trace

from pdist.engine.backend import is_device_array, is_gpu
from pdist.comm import flight_recorder, topology, watchdog
from pdist.comm.check import K, CollectiveMismatchError, agree, agree_start, default_on, fingerprint
from pdist.comm.collectives import Collectives
from pdist.comm.flight_recorder import _cur, _step
from pdist.comm.mpi import MPI, MPIP2P, contiguous_flat, wait_all
from pdist.comm.mpi_collectives import MPICollectives
from pdist.comm.objects import ObjectCollectives
from pdist.comm.pair import PairCheck
from pdist.comm.point_to_point import PointToPoint
from pdist.comm.work import Pending, Work, complete_fn, settle
from pdist.engine.backend import is_low

ALGORITHMS = {"all_reduce": ("mpi", "naive", "ring"), "reduce_scatter": ("mpi", "naive", "ring"),
              "all_gather": ("mpi", "naive", "ring"), "broadcast": ("mpi", "naive", "tree"),
              "reduce": ("mpi", "naive", "tree"), "all_to_all": ("mpi", "pairwise"), "all_to_all_v": ("mpi", "pairwise"),
              "barrier": ("mpi",)}
REDUCE_OPS = ("sum", "avg", "max", "min")


class ProcessGroup(Collectives, PointToPoint, ObjectCollectives):
    """A set of ranks that run collectives together (``rank``, ``size``,
    ``ranks`` = their world ranks in group order, ``name``)."""

    def __init__(self, comm, name="world"):
        self.comm, self.name = comm, name
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ranks = list(comm.Get_group().Translate_ranks(list(range(self.size)),
                                                           MPI.COMM_WORLD.Get_group()))
        self.check = default_on()
        self.default_algorithm = "mpi"
        self._fp, self._vcomm = comm.Dup(), comm.Dup()   # fingerprints; verdicts (check.py)
        self._mpi = MPICollectives(comm.Dup())     # MPI's collectives: replaced after a mismatch
        self._user = MPIP2P(comm)                  # send/recv of the user
        self._user_nb = MPICollectives(comm)       # isend/irecv of the user (same context)
        self._algo = MPIP2P(comm.Dup())            # hand-built algorithms: own context
        self._nccl = None
        self._seq = 0
        self._fpbuf = np.empty(2 * K, np.int64)    # the collective check's message: [f, -f]
        self._pair = PairCheck(self) if self.size == 2 else None   # two ranks: checks point-to-point (pair.py)
        self._pending, self._orphans = [], []      # async ops not yet waited on; abandoned ones
        self._last = None                          # the last collective finished (flight entry)
        self._stats = {}
        self._link = topology.link_for(self.ranks)   # simulated cluster (topology.py): None = off
        watchdog.register(self)
        if is_gpu():       # the device transport now, while every member is here (a lazy NCCL
            self._device_backend()   # init in a send/recv between two of its ranks would hang)

    def __repr__(self):
        return f"<ProcessGroup {self.name} rank {self.rank}/{self.size} world ranks {self.ranks}>"

    # ------------------------------------------------------------ accounting
    @property
    def stats(self):
        """{op: {"calls", "bytes", "wire_bytes"}} since the last ``reset_stats()`` (bytes: the
        ring accounting of collectives.py). A two-rank group's fused all-reduces count on
        their own (pair.py: two additions, the hot path) and are folded in here."""
        if self._pair is not None and self._pair.calls:
            self._pair.fold(self._count)
        return self._stats

    def reset_stats(self):
        if self._pair is not None:
            self._pair.fold(self._count)
        self._stats = {}

    def bytes_sent(self):
        """Sum over ops of the accounted bytes (the ring accounting of docs/design.md)."""
        return sum(s["bytes"] for s in self.stats.values())

    def _count(self, op, nbytes, wire=0, calls=1):
        s = self._stats.get(op)
        if s is None:
            s = self._stats[op] = {"calls": 0, "bytes": 0, "wire_bytes": 0}
        s["calls"] += calls
        s["bytes"] += int(nbytes)
        s["wire_bytes"] += int(wire)

    def _ring_bytes(self, nbytes, factor=1):
        return factor * (self.size - 1) * nbytes // self.size

    # ------------------------------------------------------------- plumbing
    def _backend(self, buf):
        """(native collectives, point-to-point) for this array: MPI or NCCL."""
        if is_device_array(buf):
            be = self._device_backend()
            return be, be.p2p
        return self._mpi, self._algo

    def _device_backend(self):
        """The transport of device arrays (gpu_transport.make_backend: NCCL, or MPI with
        host staging); created collectively, once, at group creation on a GPU backend."""
        if self._nccl is None:
            from pdist.comm.gpu_transport import make_backend
            self._nccl = make_backend(self.comm)
        return self._nccl

    def _on_nccl(self, arr):
        """True when ``arr`` travels over NCCL (a device array on a group whose transport is NCCL)."""
        return arr is not None and is_device_array(arr) and getattr(self._nccl, "kind", "") == "nccl"

    def _reset_data(self):
        """After a mismatch: a fresh communicator for MPI's collectives (collective
        over the verdict channel, which every member reaches in the same order)."""
        self._orphans.append(self._mpi)
        self._mpi = MPICollectives(self._vcomm.Dup())

    def _settle(self, error, block=True):
        """Finish earlier async ops' fingerprint checks (work.settle)."""
        return settle(self, error, block)

    def _run(self, op, *args, **kw):
        """``_run_op``, and with a consumer of measure/blocked.py on, the host time blocked in it
        (entry to return; an async op's ``wait()`` is recorded by its Work)."""
        if not blocked.ON[0]:
            return self._run_op(op, *args, **kw)
        t_in = blocked.enter()
        try:
            work = self._run_op(op, *args, **kw)
        finally:
            blocked.leave("c", self, t_in, self._seq)
        if work is not None and work._pending is not None:
            work._wf = ("w", self, self._seq)
        return work

    def _run_op(self, op, arr, theory, native, hand, algorithm, async_op,
                redop="", root=-1, error=None, then=None, keep=(), fp_size=None, verify=None):
        if algorithm is None:
            algorithm = self.default_algorithm if self.default_algorithm in ALGORITHMS[op] else "mpi"
            if arr is not None and is_low(arr.dtype):
                algorithm = "mpi"                      # 2-byte floats: MPI's path (low_precision.py) only
        if algorithm not in ALGORITHMS[op]:
            raise ValueError(f"{op}: algorithm must be one of {ALGORITHMS[op]}, got {algorithm!r}")
        if self._pending:
            error = self._settle(error, block=not (async_op and algorithm == "mpi"))
        self._seq += 1
        size, dtype = (arr.size, arr.dtype) if arr is not None else (0, None)
        size = size if fp_size is None else fp_size      # all_to_all_v: the row size, not the total
        ent = flight_recorder.enter(self, op, self._seq, size, dtype)
        pending_check = None
        if self.check:
            fp = fingerprint(op, self._seq, _step[0], size, dtype, redop, root, algorithm, error, async_op)
            what = "size" if fp_size is None else "row"        # all_to_all_v: elements per row
            describe = lambda: (str(dtype), f"{what}={size} dtype={dtype} op={redop or '-'} root={root} "  # noqa: E731
                                f"algorithm={algorithm} async_op={async_op}")
            if async_op and algorithm == "mpi" and error is None and verify is None and not self._on_nccl(arr):
                # verified in Work.wait() or at the next collective, so issuing stays non-blocking
                # (NCCL: checked before it is queued, as a mismatched kernel would hang the GPU)
                pending_check = agree_start(self, fp, error, describe)
            else:
                agree(self, fp, error, describe, self._fpbuf)
                if verify is not None and self.size > 1:   # every rank is here: check the pairs
                    err = verify()
                    agree(self, fp[:-1] + [1 if err else 0], err, describe, self._fpbuf)
        elif error:
            raise CollectiveMismatchError(f"{op} on group '{self.name}': {error}")
        args = {"op": op, "bytes": int(arr.nbytes) if arr is not None else 0,
                "group": self.name, "algorithm": algorithm}
        if self._link is not None:                 # a simulated link: charge its alpha-beta time
            then = topology.then_charge(self, op, theory, then, async_op and algorithm == "mpi")
        t0 = trace.now()
        if algorithm == "mpi":
            be = self._backend(arr)[0] if arr is not None else self._mpi
            be.verified = self.check          # every rank is here: the blocking fast path is safe
            work = native(be, async_op)
            self._count(op, theory)
        else:
            p2p = self._backend(arr)[1]
            w0 = p2p.wire_bytes
            hand[algorithm](p2p)
            self._count(op, theory, p2p.wire_bytes - w0)
            work = None
        if work is not None:
            work._then, work._span = then, (op, t0, args)
            work._keep = keep
            work._pending = p = Pending(pending_check, complete_fn(work), keep, ent, self)
            self._pending.append(p)
            _cur[0] = None
            return work
        if then is not None:
            then()
        trace.record(op, "comm", t0, trace.now(), **args)
        ent.state, self._last, _cur[0] = "done", ent, None
        return Work.completed() if async_op else None

    # ------------------------------------- argument checks of the collectives
    def _flat(self, a, what):
        try:
            return contiguous_flat(a, what), None
        except ValueError as e:
            return a.reshape(-1), str(e)

    def _avg_then(self, op, flat, only_rank=None):
        if op != "avg" or (only_rank is not None and self.rank != only_rank) or is_low(flat.dtype):
            return None              # 2-byte floats are divided before their one rounding (low_precision.py)
        n = self.size
        if n & (n - 1) == 0:                           # x * (1/n) == x / n bit for bit: 1/n is exact
            inv = 1.0 / n

            def then():
                flat.__imul__(inv)                     # flat *= 1/n in place: a multiply, not a divide
            return then

        def then():
            flat.__itruediv__(n)                       # flat /= n in place (NumPy or CuPy)
        return then

    def _verify_counts(self, send, recv):
        """After the fingerprints agreed: does rank q send this rank the ``recv[q]`` rows it
        expects? (an all-to-all of the counts on the fingerprint channel, in step on every
        rank). The error names each mismatched pair, by world rank."""
        mine, theirs = np.asarray(send, np.int64), np.empty(self.size, np.int64)
        wait_all([self._fp.Ialltoall(mine, theirs)])
        bad = [f"world rank {self.ranks[self.rank]} expects recv_counts[{q}]={recv[q]} rows from world "
               f"rank {self.ranks[q]}, which sends send_counts[{self.rank}]={int(theirs[q])}"
               for q in range(self.size) if int(theirs[q]) != recv[q]]
        return "; ".join(bad) + "; pass recv_counts = the peers' send_counts (exchange them first)" if bad else None

    @staticmethod
    def _redop_error(op, dtype):
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if op == "avg" and dtype.kind != "f" and not is_low(dtype):
            return f"op='avg' needs a floating dtype, got {dtype}"
        return None

    # -------------------------------------------------- small Python objects
    def split(self, color, key=None, name=None):
        """Sub-groups of ranks with equal ``color`` ordered by ``key`` (MPI Split). Collective."""
        sub = self._object_op("split", 0, lambda: self.comm.Split(color, self.rank if key is None else key))
        return ProcessGroup(sub, name or f"{self.name}.{color}")

