"""NCCL transport on ``cupy.cuda.nccl``, used automatically for CuPy arrays.

A ProcessGroup whose collective gets a CuPy array creates, once, an NCCL
communicator over the same ranks: rank 0 draws the 128-byte unique id
(``ncclGetUniqueId``) and broadcasts it over the group's MPI communicator; every
rank then calls ``ncclCommInitRank(n, id, rank)``. One communicator per group
(dp, tp, pp each get their own). NCCL kernels run on the group's communication stream, ordered
after the compute stream's work by an event; the compute stream is ordered after them by
the event recorded after the call (no host sync): at once for a blocking call, in
``wait()`` for an ``async_op=True`` one. The host blocks only in a device-to-host read or
a synchronize, which waits on an event under the watchdog's deadline and aborts the
communicators on a timeout (gpu_sync.py).

NCCL wants equal counts for reduce-scatter / all-gather; uneven chunks
(``chunk_bounds``) go through a buffer padded to n * max-chunk. ``op="avg"`` is
a sum followed by a division (ProcessGroup does it, as for MPI). 2-byte floats
(bfloat16 ``NCCL_BFLOAT16``, float16) reduce as on the CPU path (low_precision.py): NCCL
moves their raw bytes (an all-to-all of the chunks, then an all-gather), and the owner of
each chunk sums the n terms in float32 in rank order and rounds once, on the
communication stream; NCCL's own 2-byte sum (rounded at every hop of its ring, in an
order of its choosing) is never used, so every rank and every transport get the same bits.

Which transport a group's device arrays take (NCCL, or MPI with host staging)
is decided in gpu_transport.py. This module imports without CuPy; nothing here
touches a GPU until a group meets a CuPy array.
"""
try:  # pragma: no cover - depends on the machine
    import cupy
    from cupy.cuda import nccl as _nccl
except Exception:  # ImportError, or a CUDA library that fails to load
    cupy, _nccl = None, None

from pdist.comm import gpu_sync, low_precision
from pdist.comm.nccl_p2p import NCCLP2P, NCCLPointToPointMixin
from pdist.comm.work import Work
from pdist.engine.backend import is_low

_NAMES = {"float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32",
          "float64": "NCCL_FLOAT64", "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
          "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "bool": "NCCL_UINT8"}


def _dtype(a):
    """NCCL's datatype for ``a.dtype`` (bfloat16: NCCL_BFLOAT16 = 9, NCCL 2.10+)."""
    name = _NAMES.get(str(a.dtype))
    if name is None:
        raise TypeError(f"NCCL has no datatype for {a.dtype}: use one of {sorted(_NAMES)}")
    if not hasattr(_nccl, name):
        raise TypeError(f"this CuPy/NCCL ({getattr(_nccl, 'get_version', lambda: '?')()}) has no {name} "
                        f"for {a.dtype}: NCCL 2.10+ with CuPy 14 has it")
    return getattr(_nccl, name)


def _op(op):
    return {"sum": _nccl.NCCL_SUM, "avg": _nccl.NCCL_SUM, "max": _nccl.NCCL_MAX, "min": _nccl.NCCL_MIN}[op]


def _ptr(a):
    return a.data.ptr


class NCCLBackend(NCCLPointToPointMixin):
    """NCCL collectives for one group; same method names as MPICollectives.

    Streams: NCCL runs on the group's own communication stream. Before each call an
    event recorded on the caller's (compute) stream makes the communication stream wait
    for the kernels that produced the buffers; after it, an event recorded on the
    communication stream orders what follows: a blocking call makes the compute stream
    wait for it (on the GPU: the host does not block), an ``async_op`` one returns a Work
    whose ``wait()`` orders the compute stream after it, so a DDP bucket's all-reduce or
    ZeRO's prefetch overlaps the compute issued before wait(). Buffers an op uses stay
    referenced (the Work's ``keep``) until then.

    Point-to-point in a batch (``with be.group_p2p(): ...isend/irecv...``): the sends and
    receives are posted in one NCCL group call (ncclGroupStart/End), which NCCL progresses
    together, so a send and a receive between two ranks can't deadlock the way two lone
    sends (each blocking its stream until matched) do. A rank's message to itself (the
    interleaved pipeline with one stage) is a local copy: NCCL refuses self-sends."""
    kind = "nccl"
    cupy = cupy
    _nccl = _nccl
    _dtype = staticmethod(_dtype)

    def __init__(self, mpi_comm):
        if _nccl is None:
            raise RuntimeError("CuPy arrays need cupy with NCCL: pip install 'pdist[gpu]'")
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = _nccl.get_unique_id() if self.rank == 0 else None      # 128 bytes (CuPy 14)
        uid = mpi_comm.bcast(uid, root=0)                    # the id travels over MPI
        self.nc = _nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.p2p = self.user_p2p = NCCLP2P(self)
        self._batch, self._self = None, {}
        self.verified = False
        gpu_sync.register(self)

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
        """The compute stream after ``done``: now (blocking call) or in the Work's wait()."""
        wait = lambda: cupy.cuda.get_current_stream().wait_event(done)   # noqa: E731
        if not nb:
            wait()
            return None
        return Work(wait=wait, test=lambda: done.done, keep=keep)

    def _finish_low(self, done_keep, nb):
        done, keep = done_keep
        return self._finish(done, nb, keep)

    def _on_stream(self, fn):
        """Run ``fn()`` (CuPy kernels) on the communication stream; the event after it."""
        with self.stream:
            fn()
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return done

    # ---------------------------------------------------------- collectives
    def all_reduce(self, buf, op, nb=False):
        if is_low(buf.dtype) and buf.size:
            return self._finish_low(low_precision.nccl_all_reduce(self, buf, op), nb)
        if not buf.size:
            return self._finish(self._issue(lambda s: None), nb)
        return self._finish(self._issue(lambda s: self.nc.allReduce(
            _ptr(buf), _ptr(buf), buf.size, _dtype(buf), _op(op), s)), nb, (buf,))

    def reduce_scatter(self, out, inp, counts, op, nb=False):
        m, n = max(counts), self.size
        if not m:
            return self._finish(self._issue(lambda s: None), nb)
        if is_low(inp.dtype):
            return self._finish_low(low_precision.nccl_reduce_scatter(self, out, inp, counts, op), nb)
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
        if is_low(buf.dtype):
            return self._finish_low(low_precision.nccl_reduce(self, buf, dst, op), nb)
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

    def all_to_all_v(self, out, inp, send_counts, recv_counts, nb=False):
        """Grouped send/recv of each peer's block (counts in elements); empty blocks skipped
        on both sides, this rank's own block a device copy."""
        from pdist.comm.algorithms import displacements
        r, sd, rd = self.rank, displacements(send_counts), displacements(recv_counts)
        out[rd[r]:rd[r] + recv_counts[r]] = inp[sd[r]:sd[r] + send_counts[r]]
        peers = [q for q in range(self.size) if q != r and (send_counts[q] or recv_counts[q])]

        def go(s):
            dt = _dtype(inp)
            _nccl.groupStart()
            for q in peers:
                if send_counts[q]:
                    self.nc.send(_ptr(inp[sd[q]:]), send_counts[q], dt, q, s)
                if recv_counts[q]:
                    self.nc.recv(_ptr(out[rd[q]:]), recv_counts[q], dt, q, s)
            _nccl.groupEnd()
        return self._finish(self._issue(go if peers else lambda s: None), nb, (out, inp))

    def barrier(self, nb=False):
        one = cupy.zeros(1, cupy.float32)
        return self.all_reduce(one, "sum", nb)
