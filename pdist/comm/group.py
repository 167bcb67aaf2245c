"""ProcessGroup: the collective API every strategy calls, with accounting.

Arrays are of the active backend (NumPy or CuPy), C-contiguous, any shape
(read flat); results land in place / in ``out``. A call returns ``None``, or a
``Work`` (``wait()``, ``is_completed()``) with ``async_op=True``. The group picks
the transport from the array: NumPy -> MPI (mpi.py), CuPy -> NCCL (nccl.py),
so strategy code never branches on either.

Algorithms: ``"mpi"`` (the default: the transport's own collective), and the
hand-built ones of algorithms.py over point-to-point: all_reduce ``naive``,
``ring``; reduce_scatter / all_gather ``naive``, ``ring``; broadcast ``naive``,
``tree``; reduce ``naive``, ``tree``; all_to_all ``pairwise``. Hand-built
algorithms run eagerly: with ``async_op=True`` they return a completed Work.

Accounting (docs/design.md; what this rank sends, the way a ring moves it; S = the
full tensor's bytes, n = group size), ``pg.stats[op]["bytes"]``:

    all_reduce 2(n-1)/n*S   reduce_scatter, all_gather (n-1)/n*S
    broadcast, reduce (n-1)/n*S (a pipelined chain: n-1 of n ranks forward S)
    all_to_all (n-1)/n*S    send S, recv 0, barrier 0

``pg.stats[op]["wire_bytes"]`` counts the bytes this rank really sent in the
hand-built algorithms and in send/isend (MPI's own collectives are opaque to
us: they add 0), so a lesson can set an algorithm beside the theory.

Safety (docs/failures.md): every call is fingerprinted (check.py) and recorded
in the flight recorder, every wait has a deadline (watchdog.py), and an async
op's buffers are held until it is waited on (work.py). Before a new
collective the group settles earlier async ops: it finishes their fingerprint
checks (so a mismatch is raised on every rank in the same order; before another
async op, only the checks already complete) and reports any whose handle was
dropped without ``wait()``.
"""
import numpy as np

from pdist.measure import trace
from contextlib import nullcontext

from pdist.engine.backend import array_module, is_device_array, is_gpu
from pdist.comm import algorithms as alg
from pdist.comm.algorithms import chunk_bounds
from pdist.comm import topology, watchdog
from pdist.comm.check import CollectiveMismatchError, agree, agree_start, default_on, fingerprint
from pdist.comm.mpi import MPI, MPICollectives, MPIP2P, contiguous_flat
from pdist.comm.watchdog import _cur, _step
from pdist.comm.objects import ObjectCollectives
from pdist.comm.work import Pending, Work, settle
from pdist.engine.backend import is_low

ALGORITHMS = {"all_reduce": ("mpi", "naive", "ring"), "reduce_scatter": ("mpi", "naive", "ring"),
              "all_gather": ("mpi", "naive", "ring"), "broadcast": ("mpi", "naive", "tree"),
              "reduce": ("mpi", "naive", "tree"), "all_to_all": ("mpi", "pairwise"), "barrier": ("mpi",)}
REDUCE_OPS = ("sum", "avg", "max", "min")


class ProcessGroup(ObjectCollectives):
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
        self._fpbuf = np.empty(20, np.int64)       # the collective check's message
        self._pending, self._orphans = [], []      # async ops not yet waited on; abandoned ones
        self._last = None                          # the last collective finished (flight entry)
        self.stats = {}
        self._link = topology.link_for(self.ranks)   # simulated cluster (topology.py): None = off
        watchdog.register(self)
        if is_gpu():       # the device transport now, while every member is here (a lazy NCCL
            self._device_backend()   # init in a send/recv between two of its ranks would hang)

    def __repr__(self):
        return f"<ProcessGroup {self.name} rank {self.rank}/{self.size} world ranks {self.ranks}>"

    # ------------------------------------------------------------ accounting
    def reset_stats(self):
        self.stats = {}

    def bytes_sent(self):
        """Sum over ops of the accounted bytes (the ring accounting of docs/design.md)."""
        return sum(s["bytes"] for s in self.stats.values())

    def _count(self, op, nbytes, wire=0):
        s = self.stats.get(op)
        if s is None:
            s = self.stats[op] = {"calls": 0, "bytes": 0, "wire_bytes": 0}
        s["calls"] += 1
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
        """The transport of device arrays (nccl.make_backend: NCCL, or MPI with host
        staging); created collectively, once, at group creation on a GPU backend."""
        if self._nccl is None:
            from pdist.comm.nccl import make_backend
            self._nccl = make_backend(self.comm)
        return self._nccl

    def _reset_data(self):
        """After a mismatch: a fresh communicator for MPI's collectives (collective
        over the verdict channel, which every member reaches in the same order)."""
        self._orphans.append(self._mpi)
        self._mpi = MPICollectives(self._vcomm.Dup())

    def _settle(self, error, block=True):
        """Finish earlier async ops' fingerprint checks (work.settle)."""
        return settle(self, error, block)

    def _run(self, op, arr, theory, native, hand, algorithm, async_op,
             redop="", root=-1, error=None, then=None, keep=()):
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
        ent = watchdog.enter(self, op, self._seq, size, dtype)
        pending_check = None
        if self.check:
            fp = fingerprint(op, self._seq, _step[0], size, dtype, redop, root, algorithm, error, async_op)
            describe = lambda: (str(dtype), f"size={size} dtype={dtype} op={redop or '-'} root={root} "  # noqa: E731
                                f"algorithm={algorithm} async_op={async_op}")
            if async_op and algorithm == "mpi" and error is None:
                # verified in Work.wait() or at the next collective, so issuing stays non-blocking
                pending_check = agree_start(self, fp, error, describe)
            else:
                agree(self, fp, error, describe, self._fpbuf)
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
            work._pending = p = Pending(pending_check, work._wait, keep, ent, self)
            self._pending.append(p)
            _cur[0] = None
            return work
        if then is not None:
            then()
        trace.record(op, "comm", t0, trace.now(), **args)
        ent.state, self._last, _cur[0] = "done", ent, None
        return Work.completed() if async_op else None

    def _flat(self, a, what):
        try:
            return contiguous_flat(a, what), None
        except ValueError as e:
            return a.reshape(-1), str(e)

    def _avg_then(self, op, flat, only_rank=None):
        if op != "avg" or (only_rank is not None and self.rank != only_rank) or is_low(flat.dtype):
            return None              # 2-byte floats are divided before their one rounding (low_precision.py)
        n = self.size

        def then():
            flat.__itruediv__(n)                       # flat /= n in place (NumPy or CuPy)
        return then

    @staticmethod
    def _redop_error(op, dtype):
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if op == "avg" and dtype.kind != "f" and not is_low(dtype):
            return f"op='avg' needs a floating dtype, got {dtype}"
        return None

    # ----------------------------------------------------------- collectives
    def all_reduce(self, buf, op="sum", algorithm=None, async_op=False):
        """buf <- buf_0 (op) ... (op) buf_{n-1} on every rank (op: sum, avg, max, min)."""
        flat, err = self._flat(buf, "all_reduce buf")
        err = err or self._redop_error(op, buf.dtype)
        hand = {"naive": lambda t: alg.allreduce_naive(t, flat, op),
                "ring": lambda t: alg.allreduce_ring(t, flat, op)}
        return self._run("all_reduce", flat, self._ring_bytes(flat.nbytes, 2),
                         lambda c, nb: c.all_reduce(flat, op, nb), hand, algorithm, async_op, redop=op, error=err,
                         then=self._avg_then(op, flat), keep=(flat,))

    def reduce_scatter(self, out, inp, op="sum", algorithm=None, async_op=False):
        """out_r <- chunk_bounds(inp.size, n)[r] of (inp_0 (op) ... (op) inp_{n-1})."""
        fi, e1 = self._flat(inp, "reduce_scatter inp")
        fo, e2 = self._flat(out, "reduce_scatter out")
        bounds = chunk_bounds(fi.size, self.size)
        counts = [b - a for a, b in bounds]
        err = e1 or e2 or self._redop_error(op, inp.dtype)
        if not err and fo.size != counts[self.rank]:
            err = (f"out.size {fo.size} != its chunk of inp ({counts[self.rank]} of {fi.size} "
                   f"elements, chunk_bounds({fi.size}, {self.size})[{self.rank}])")
        if not err and out.dtype != inp.dtype:
            err = f"out.dtype {out.dtype} != inp.dtype {inp.dtype}"
        hand = {"naive": lambda t: alg.reduce_scatter_naive(t, fo, fi, op),
                "ring": lambda t: alg.reduce_scatter_ring(t, fo, fi, op)}
        return self._run("reduce_scatter", fi, self._ring_bytes(fi.nbytes),
                         lambda c, nb: c.reduce_scatter(fo, fi, counts, op, nb), hand, algorithm, async_op, redop=op, error=err,
                         then=self._avg_then(op, fo), keep=(fo, fi))

    def all_gather(self, out, inp, algorithm=None, async_op=False):
        """out[chunk_bounds(out.size, n)[q]] <- inp_q on every rank."""
        fi, e1 = self._flat(inp, "all_gather inp")
        fo, e2 = self._flat(out, "all_gather out")
        counts = [b - a for a, b in chunk_bounds(fo.size, self.size)]
        err = e1 or e2
        if not err and fi.size != counts[self.rank]:
            err = (f"inp.size {fi.size} != its chunk of out ({counts[self.rank]} of {fo.size} "
                   f"elements, chunk_bounds({fo.size}, {self.size})[{self.rank}])")
        if not err and out.dtype != inp.dtype:
            err = f"out.dtype {out.dtype} != inp.dtype {inp.dtype}"
        hand = {"naive": lambda t: alg.all_gather_naive(t, fo, fi),
                "ring": lambda t: alg.all_gather_ring(t, fo, fi)}
        return self._run("all_gather", fo, self._ring_bytes(fo.nbytes),
                         lambda c, nb: c.all_gather(fo, fi, counts, nb), hand, algorithm, async_op, error=err,
                         keep=(fo, fi))

    def all_gather_list(self, inp, algorithm=None):
        """[inp_0, ..., inp_{n-1}] (equal shapes) on every rank."""
        xp = array_module(inp)
        k = inp.size
        out = xp.empty(k * self.size, dtype=inp.dtype)
        self.all_gather(out, xp.ascontiguousarray(inp), algorithm=algorithm)
        return [out[q * k:(q + 1) * k].reshape(inp.shape) for q in range(self.size)]

    def broadcast(self, buf, src=0, algorithm=None, async_op=False):
        """buf_r <- buf_src on every rank."""
        flat, err = self._flat(buf, "broadcast buf")
        if not 0 <= src < self.size:
            err = err or f"src={src} is not a rank of a group of {self.size}"
        hand = {"naive": lambda t: alg.broadcast_naive(t, flat, src),
                "tree": lambda t: alg.broadcast_tree(t, flat, src)}
        return self._run("broadcast", flat, self._ring_bytes(flat.nbytes),
                         lambda c, nb: c.broadcast(flat, src, nb), hand, algorithm, async_op, root=src, error=err,
                         keep=(flat,))

    def reduce(self, buf, dst=0, op="sum", algorithm=None, async_op=False):
        """buf_dst <- buf_0 (op) ... (op) buf_{n-1}; buf elsewhere unchanged."""
        flat, err = self._flat(buf, "reduce buf")
        err = err or self._redop_error(op, buf.dtype)
        if not 0 <= dst < self.size:
            err = err or f"dst={dst} is not a rank of a group of {self.size}"
        hand = {"naive": lambda t: alg.reduce_naive(t, flat, dst, op),
                "tree": lambda t: alg.reduce_tree(t, flat, dst, op)}
        return self._run("reduce", flat, self._ring_bytes(flat.nbytes),
                         lambda c, nb: c.reduce(flat, dst, op, nb), hand, algorithm, async_op, redop=op, root=dst,
                         error=err, then=self._avg_then(op, flat, only_rank=dst), keep=(flat,))

    def all_to_all(self, out, inp, algorithm=None, async_op=False):
        """Axis-0 chunk q of inp goes to rank q; out's chunk q comes from rank q."""
        fi, e1 = self._flat(inp, "all_to_all inp")
        fo, e2 = self._flat(out, "all_to_all out")
        err = e1 or e2
        if not err and (inp.ndim == 0 or inp.shape[0] % self.size):
            err = f"inp.shape[0] ({inp.shape[0] if inp.ndim else 'scalar'}) must be divisible by {self.size}"
        if not err and (fo.size != fi.size or out.dtype != inp.dtype):
            err = f"out ({fo.size} x {out.dtype}) must match inp ({fi.size} x {inp.dtype})"
        return self._run("all_to_all", fi, self._ring_bytes(fi.nbytes),
                         lambda c, nb: c.all_to_all(fo, fi, nb),
                         {"pairwise": lambda t: alg.all_to_all_pairwise(t, fo, fi)}, algorithm, async_op, error=err,
                         keep=(fo, fi))

    def barrier(self, async_op=False):
        """Return once every rank of the group has called barrier()."""
        return self._run("barrier", None, 0, lambda c, nb: c.barrier(nb), {}, "mpi", async_op)

    # ------------------------------------------------------- point-to-point
    def _p2p(self, op, buf, peer, nbytes, start):
        flat = contiguous_flat(buf, f"{op} buf")
        if not 0 <= peer < self.size:
            raise ValueError(f"{op}: peer {peer} is not a rank of group '{self.name}' (size {self.size})")
        self._count("send" if op in ("send", "isend") else "recv", nbytes, nbytes)
        ent = watchdog.enter(self, op, 0, flat.size, flat.dtype, peer=self.ranks[peer])
        t0 = trace.now()
        work = start(flat)
        args = {"op": op, "bytes": int(flat.nbytes), "group": self.name, "peer": peer}
        if self._link is not None:                 # a simulated link between the two ranks
            link = topology.link_for([self.ranks[self.rank], self.ranks[peer]])
            if work is None:
                topology.charge(self, op, flat.nbytes, link)
            else:
                since, w = trace.now(), work._wait
                work._wait = lambda: (w(), topology.charge(self, op, flat.nbytes, link, since))
        if work is None:
            trace.record(op, "comm", t0, trace.now(), **args)
            ent.state = "done"
        else:
            work._span, inner = (op, t0, args), work._wait
            work._wait = lambda: (_cur.__setitem__(0, ent), inner())   # waits report this call
        _cur[0] = None
        return work

    def _pt(self, buf):
        return self._backend(buf)[1] if is_device_array(buf) else self._user

    def send(self, buf, dst, tag=0):
        """Send buf to rank ``dst`` of this group (blocks until buf is reusable)."""
        self._p2p("send", buf, dst, buf.nbytes, lambda f: self._pt(buf).send(f, dst, tag))

    def recv(self, buf, src, tag=0):
        """Receive into buf from rank ``src`` (size and dtype must match the send)."""
        self._p2p("recv", buf, src, 0, lambda f: self._pt(buf).recv(f, src, tag))

    def isend(self, buf, dst, tag=0):
        """Non-blocking send: returns a Work; buf must stay untouched until wait()."""
        return self._p2p("isend", buf, dst, buf.nbytes, lambda f: self._native(buf).isend(f, dst, tag))

    def irecv(self, buf, src, tag=0):
        """Non-blocking receive: returns a Work; buf is valid after wait()."""
        return self._p2p("irecv", buf, src, 0, lambda f: self._native(buf).irecv(f, src, tag))

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        """Send ``sendbuf`` to rank ``dst`` while receiving ``recvbuf`` from rank ``src``;
        returns when both are done. The deadlock-free exchange: the receive is posted
        before either side waits, so a ring (every rank sends right, receives left) never
        deadlocks, where ``send`` then ``recv`` on every rank waits forever once a message
        is too large for MPI to buffer (docs/collectives.md). Counts as a send of
        sendbuf.nbytes (stats["send"]) and a receive."""
        r = self.irecv(recvbuf, src, tag)
        s = self.isend(sendbuf, dst, tag)
        r.wait()
        s.wait()

    def batch_isend_irecv(self, ops):
        """Post ``ops`` = [("send"|"recv", buf, peer, tag)] together; returns their Works
        in order. Over MPI each is an ``isend``/``irecv``. Over NCCL they go out in one
        group call (ncclGroupStart/End), so a send and a receive between two ranks in one
        batch can't deadlock (a lone NCCL send blocks its stream until matched), and a
        message to this rank itself is a local copy."""
        if not ops:
            return []
        native = self._native(ops[0][1])
        with getattr(native, "group_p2p", nullcontext)():
            return [(self.isend if kind == "send" else self.irecv)(buf, peer, tag)
                    for kind, buf, peer, tag in ops]

    def _native(self, buf):
        return self._backend(buf)[0] if is_device_array(buf) else self._user_nb

    # -------------------------------------------------- small Python objects
    def split(self, color, key=None, name=None):
        """Sub-groups of ranks with equal ``color`` ordered by ``key`` (MPI Split). Collective."""
        sub = self._object_op("split", 0, lambda: self.comm.Split(color, self.rank if key is None else key))
        return ProcessGroup(sub, name or f"{self.name}.{color}")
