"""NCCL transport on ``cupy.cuda.nccl``, used automatically for CuPy arrays.

A ProcessGroup whose collective gets a CuPy array creates, once, an NCCL
communicator over the same ranks: rank 0 draws the 128-byte unique id
(``ncclGetUniqueId``) and broadcasts it over the group's MPI communicator; every
rank then calls ``ncclCommInitRank(n, id, rank)``. One communicator per group
(dp, tp, pp each get their own). NCCL kernels run on CuPy's current stream, so
later CuPy work on that stream is ordered after them without a host sync; an
``async_op=True`` call returns a ``Work`` whose ``wait()`` polls a CUDA event
recorded after the NCCL call (``watchdog.poll``: with the deadline).

NCCL wants equal counts for reduce-scatter / all-gather; uneven chunks
(``chunk_bounds``) go through a buffer padded to n * max-chunk. ``op="avg"`` is
a sum followed by a division (ProcessGroup does it, as for MPI).

Which transport a group's device arrays take (NCCL, or MPI with host staging)
is decided in gpu_transport.py. This module imports without CuPy; nothing here
touches a GPU until a group meets a CuPy array.
"""
from contextlib import contextmanager

try:  # pragma: no cover - depends on the machine
    import cupy
    from cupy.cuda import nccl as _nccl
except Exception:  # ImportError, or a CUDA library that fails to load
    cupy, _nccl = None, None

from pdist.comm import watchdog
from pdist.comm.work import Work


def _dtype(a):
    names = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
             "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
             "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "bool": "NCCL_UINT8"}
    name = names.get(str(a.dtype))
    if name is None:
        raise TypeError(f"NCCL has no datatype for {a.dtype}")
    return getattr(_nccl, name)


def _op(op):
    return {"sum": _nccl.NCCL_SUM, "avg": _nccl.NCCL_SUM, "max": _nccl.NCCL_MAX, "min": _nccl.NCCL_MIN}[op]


def _ptr(a):
    return a.data.ptr


class NCCLBackend:
    """NCCL collectives for one group; same method names as MPICollectives.

    Streams: NCCL runs on the group's own communication stream. Before each call an
    event recorded on the caller's (compute) stream makes the communication stream wait
    for the kernels that produced the buffers; after it, an event recorded on the
    communication stream orders what follows: a blocking call makes the compute stream
    wait for it (on the GPU: the host does not block), an ``async_op`` one returns a Work
    whose ``wait()`` polls that event and then orders the compute stream after it, so a
    DDP bucket's all-reduce or ZeRO's prefetch overlaps the compute issued before wait().

    Point-to-point in a batch (``with be.group_p2p(): ...isend/irecv...``): the sends and
    receives are posted in one NCCL group call (ncclGroupStart/End), which NCCL progresses
    together, so a send and a receive between two ranks can't deadlock the way two lone
    sends (each blocking its stream until matched) do. A rank's message to itself (the
    interleaved pipeline with one stage) is a local copy: NCCL refuses self-sends."""

    def __init__(self, mpi_comm):
        if _nccl is None:
            raise RuntimeError("CuPy arrays need cupy with NCCL: pip install 'pdist[gpu]'")
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = _nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)                    # the id travels over MPI
        self.nc = _nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.p2p = NCCLP2P(self)
        self._batch, self._self = None, {}
        self.verified = False

    # ------------------------------------------------------------- streams
    def _issue(self, fn):
        """Run ``fn(stream_ptr)`` on the communication stream after the compute stream's
        work so far; returns the event recorded after it."""
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        fn(self.stream.ptr)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return done

    def _finish(self, done, nb, keep=()):
        if not nb:
            cupy.cuda.get_current_stream().wait_event(done)
            return None

        def wait():
            watchdog.poll(lambda: done.done)
            cupy.cuda.get_current_stream().wait_event(done)
        return Work(wait=wait, test=lambda: done.done, keep=keep)

    # ---------------------------------------------------------- collectives
    def all_reduce(self, buf, op, nb=False):
        if not buf.size:
            return self._finish(self._issue(lambda s: None), nb)
        return self._finish(self._issue(lambda s: self.nc.allReduce(
            _ptr(buf), _ptr(buf), buf.size, _dtype(buf), _op(op), s)), nb, (buf,))

    def reduce_scatter(self, out, inp, counts, op, nb=False):
        m, n = max(counts), self.size
        if not m:
            return self._finish(self._issue(lambda s: None), nb)
        if len(set(counts)) == 1:
            return self._finish(self._issue(lambda s: self.nc.reduceScatter(
                _ptr(inp), _ptr(out), m, _dtype(inp), _op(op), s)), nb, (out, inp))
        pad, res, start = cupy.zeros(n * m, inp.dtype), cupy.empty(m, inp.dtype), 0   # chunks padded to m
        for q, c in enumerate(counts):
            pad[q * m:q * m + c] = inp[start:start + c]
            start += c
        done = self._issue(lambda s: self.nc.reduceScatter(_ptr(pad), _ptr(res), m, _dtype(inp), _op(op), s))
        cupy.cuda.get_current_stream().wait_event(done)
        out[...] = res[:counts[self.rank]]
        return self._finish(done, nb, (pad, res))

    def all_gather(self, out, inp, counts, nb=False):
        m, n = max(counts), self.size
        if not m:
            return self._finish(self._issue(lambda s: None), nb)
        if len(set(counts)) == 1:
            return self._finish(self._issue(lambda s: self.nc.allGather(
                _ptr(inp), _ptr(out), m, _dtype(inp), s)), nb, (out, inp))
        send, pad = cupy.zeros(m, inp.dtype), cupy.empty(n * m, inp.dtype)
        send[:inp.size] = inp
        done = self._issue(lambda s: self.nc.allGather(_ptr(send), _ptr(pad), m, _dtype(inp), s))
        cupy.cuda.get_current_stream().wait_event(done)
        start = 0
        for q, c in enumerate(counts):
            out[start:start + c] = pad[q * m:q * m + c]
            start += c
        return self._finish(done, nb, (send, pad))

    def broadcast(self, buf, src, nb=False):
        if not buf.size:
            return self._finish(self._issue(lambda s: None), nb)
        return self._finish(self._issue(lambda s: self.nc.bcast(
            _ptr(buf), buf.size, _dtype(buf), src, s)), nb, (buf,))

    def reduce(self, buf, dst, op, nb=False):
        if not buf.size:
            return self._finish(self._issue(lambda s: None), nb)
        tmp = buf if self.rank == dst else cupy.empty_like(buf)   # non-root buf unchanged
        return self._finish(self._issue(lambda s: self.nc.reduce(
            _ptr(buf), _ptr(tmp), buf.size, _dtype(buf), _op(op), dst, s)), nb, (buf, tmp))

    def all_to_all(self, out, inp, nb=False):
        k = inp.size // self.size
        out[self.rank * k:(self.rank + 1) * k] = inp[self.rank * k:(self.rank + 1) * k]

        def go(s):
            dt = _dtype(inp)
            _nccl.groupStart()
            for q in range(self.size):
                if q != self.rank:
                    self.nc.send(_ptr(inp[q * k:(q + 1) * k]), k, dt, q, s)
                    self.nc.recv(_ptr(out[q * k:(q + 1) * k]), k, dt, q, s)
            _nccl.groupEnd()
        return self._finish(self._issue(go if k and self.size > 1 else lambda s: None), nb, (out, inp))

    def barrier(self, nb=False):
        one = cupy.zeros(1, cupy.float32)
        return self.all_reduce(one, "sum", nb)

    # ------------------------------------------------------- point-to-point
    @contextmanager
    def group_p2p(self):
        """Collect the isend/irecv issued inside; post them as one NCCL group call at the end."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
        self._post(batch)

    def _post(self, batch):
        """Post [(kind, buf, peer, tag, holder)]: self-messages as copies (sends first), the
        rest in one group call; every holder gets the event recorded after it."""
        for kind, buf, peer, tag, _ in batch:
            if kind == "send" and peer == self.rank:
                self._self.setdefault(tag, []).append(buf.copy())
        for kind, buf, peer, tag, _ in batch:
            if kind == "recv" and peer == self.rank:
                q = self._self.get(tag)
                if not q:
                    raise RuntimeError(f"NCCL: a receive from this rank itself (tag {tag}) before the "
                                       "matching send: the program must send to itself first")
                buf[...] = q.pop(0)
        wire = [(k, b, p) for k, b, p, _, _ in batch if p != self.rank and b.size]

        def go(s):
            if not wire:
                return
            _nccl.groupStart()
            for kind, buf, peer in wire:
                if kind == "send":
                    self.nc.send(_ptr(buf), buf.size, _dtype(buf), peer, s)
                else:
                    self.nc.recv(_ptr(buf), buf.size, _dtype(buf), peer, s)
            _nccl.groupEnd()
        done = self._issue(go)
        for *_, holder in batch:
            holder.append(done)

    def _p2p_work(self, kind, buf, peer, tag):
        holder = []
        if self._batch is not None:
            self._batch.append((kind, buf, peer, tag, holder))
        else:
            self._post([(kind, buf, peer, tag, holder)])

        def wait():
            done = holder[0]
            watchdog.poll(lambda: done.done)
            cupy.cuda.get_current_stream().wait_event(done)
        return Work(wait=wait, test=lambda: bool(holder) and holder[0].done, keep=(buf,))

    def isend(self, buf, dst, tag=0):
        self.p2p.wire_bytes += buf.nbytes
        return self._p2p_work("send", buf, dst, tag)

    def irecv(self, buf, src, tag=0):
        return self._p2p_work("recv", buf, src, tag)


class NCCLP2P:
    """send / recv / sendrecv over NCCL (the hand-built algorithms' transport), on the
    group's communication stream, the compute stream ordered after each.
    NCCL has no tags: messages between two ranks match in issue order."""

    def __init__(self, be):
        self.be, self.nc, self.rank, self.size, self.wire_bytes = be, be.nc, be.rank, be.size, 0

    def _do(self, fn):
        cupy.cuda.get_current_stream().wait_event(self.be._issue(fn))

    def send(self, buf, dst, tag=0):
        self.wire_bytes += buf.nbytes
        if buf.size:
            self._do(lambda s: self.nc.send(_ptr(buf), buf.size, _dtype(buf), dst, s))

    def recv(self, buf, src, tag=0):
        if buf.size:
            self._do(lambda s: self.nc.recv(_ptr(buf), buf.size, _dtype(buf), src, s))

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        self.wire_bytes += sendbuf.nbytes

        def go(s):
            _nccl.groupStart()                                # both at once: no deadlock in a ring
            if sendbuf.size:
                self.nc.send(_ptr(sendbuf), sendbuf.size, _dtype(sendbuf), dst, s)
            if recvbuf.size:
                self.nc.recv(_ptr(recvbuf), recvbuf.size, _dtype(recvbuf), src, s)
            _nccl.groupEnd()
        self._do(go)

    def sendrecv_iter(self, sendbuf, dst, recvbuf, src, tag=0):
        """One segment: the GPU already overlaps (kernels queue on the stream)."""
        self.sendrecv(sendbuf, dst, recvbuf, src, tag)
        yield 0, recvbuf.size
