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

This module imports without CuPy (``available()`` is then False); nothing here
touches a GPU until a group meets a CuPy array.
"""
try:  # pragma: no cover - depends on the machine
    import cupy
    from cupy.cuda import nccl as _nccl
except Exception:  # ImportError, or a CUDA library that fails to load
    cupy, _nccl = None, None

from pdist.comm import watchdog
from pdist.comm.work import Work


def available():
    """True when CuPy with NCCL is importable and a CUDA device is visible."""
    if _nccl is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # pragma: no cover
        return False


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
    """NCCL collectives for one group; same method names as MPICollectives."""

    def __init__(self, mpi_comm):
        if _nccl is None:
            raise RuntimeError("CuPy arrays need cupy with NCCL: pip install 'pdist[gpu]'")
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = _nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)                    # the id travels over MPI
        self.nc = _nccl.NcclCommunicator(self.size, uid, self.rank)
        self.p2p = NCCLP2P(self.nc, self.rank, self.size)

    @staticmethod
    def _stream():
        return cupy.cuda.get_current_stream()

    def _finish(self, nb):
        if not nb:
            return None
        ev = cupy.cuda.Event()
        ev.record(self._stream())
        return Work(wait=lambda: watchdog.poll(lambda: ev.done), test=lambda: ev.done)

    def all_reduce(self, buf, op, nb=False):
        if buf.size:
            self.nc.allReduce(_ptr(buf), _ptr(buf), buf.size, _dtype(buf), _op(op), self._stream().ptr)
        return self._finish(nb)

    def reduce_scatter(self, out, inp, counts, op, nb=False):
        m, n = max(counts), self.size
        if m:
            if len(set(counts)) == 1:
                self.nc.reduceScatter(_ptr(inp), _ptr(out), m, _dtype(inp), _op(op), self._stream().ptr)
            else:                                            # pad each chunk to m elements
                pad, res, start = cupy.zeros(n * m, inp.dtype), cupy.empty(m, inp.dtype), 0
                for q, c in enumerate(counts):
                    pad[q * m:q * m + c] = inp[start:start + c]
                    start += c
                self.nc.reduceScatter(_ptr(pad), _ptr(res), m, _dtype(inp), _op(op), self._stream().ptr)
                out[...] = res[:counts[self.rank]]
        return self._finish(nb)

    def all_gather(self, out, inp, counts, nb=False):
        m, n = max(counts), self.size
        if m:
            if len(set(counts)) == 1:
                self.nc.allGather(_ptr(inp), _ptr(out), m, _dtype(inp), self._stream().ptr)
            else:
                send, pad = cupy.zeros(m, inp.dtype), cupy.empty(n * m, inp.dtype)
                send[:inp.size] = inp
                self.nc.allGather(_ptr(send), _ptr(pad), m, _dtype(inp), self._stream().ptr)
                start = 0
                for q, c in enumerate(counts):
                    out[start:start + c] = pad[q * m:q * m + c]
                    start += c
        return self._finish(nb)

    def broadcast(self, buf, src, nb=False):
        if buf.size:
            self.nc.bcast(_ptr(buf), buf.size, _dtype(buf), src, self._stream().ptr)
        return self._finish(nb)

    def reduce(self, buf, dst, op, nb=False):
        if buf.size:
            tmp = buf if self.rank == dst else cupy.empty_like(buf)   # non-root buf unchanged
            self.nc.reduce(_ptr(buf), _ptr(tmp), buf.size, _dtype(buf), _op(op), dst, self._stream().ptr)
        return self._finish(nb)

    def all_to_all(self, out, inp, nb=False):
        k = inp.size // self.size
        if k:
            s, dt = self._stream().ptr, _dtype(inp)
            _nccl.groupStart()
            for q in range(self.size):
                self.nc.send(_ptr(inp[q * k:(q + 1) * k]), k, dt, q, s)
                self.nc.recv(_ptr(out[q * k:(q + 1) * k]), k, dt, q, s)
            _nccl.groupEnd()
        return self._finish(nb)

    def isend(self, buf, dst, tag=0):
        self.p2p.send(buf, dst, tag)
        return self._finish(True)

    def irecv(self, buf, src, tag=0):
        self.p2p.recv(buf, src, tag)
        return self._finish(True)


class NCCLP2P:
    """send / recv / sendrecv over NCCL (the hand-built algorithms' transport).
    NCCL has no tags: messages between two ranks match in issue order."""

    def __init__(self, nc, rank, size):
        self.nc, self.rank, self.size, self.wire_bytes = nc, rank, size, 0

    def send(self, buf, dst, tag=0):
        self.wire_bytes += buf.nbytes
        if buf.size:
            self.nc.send(_ptr(buf), buf.size, _dtype(buf), dst, cupy.cuda.get_current_stream().ptr)

    def recv(self, buf, src, tag=0):
        if buf.size:
            self.nc.recv(_ptr(buf), buf.size, _dtype(buf), src, cupy.cuda.get_current_stream().ptr)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        self.wire_bytes += sendbuf.nbytes
        s = cupy.cuda.get_current_stream().ptr
        _nccl.groupStart()                                   # both at once: no deadlock in a ring
        if sendbuf.size:
            self.nc.send(_ptr(sendbuf), sendbuf.size, _dtype(sendbuf), dst, s)
        if recvbuf.size:
            self.nc.recv(_ptr(recvbuf), recvbuf.size, _dtype(recvbuf), src, s)
        _nccl.groupEnd()

    def sendrecv_iter(self, sendbuf, dst, recvbuf, src, tag=0):
        """One segment: the GPU already overlaps (kernels queue on the stream)."""
        self.sendrecv(sendbuf, dst, recvbuf, src, tag)
        yield 0, recvbuf.size
