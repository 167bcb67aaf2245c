"""cupy.cuda.nccl stand-in: NCCL's API and semantics emulated over MPI on the host.

The public names, constants and signatures are CuPy 14.2's (``get_unique_id()`` returns 128
bytes; ``NCCL_BFLOAT16 = 9``, ``NCCL_AVG = 4``). Buffers are device pointers
(``a.data.ptr``), as in NCCL; the emulation reads and writes the memory behind them.
Semantics kept: a communicator is created by the ``ndev`` ranks that share a unique id
(collective over those ranks only); point-to-point messages carry no tag and match in issue
order; between ``groupStart`` and ``groupEnd`` operations are only queued, and ``groupEnd``
posts them all at once and returns when all are done; a lone ``send`` of more than
``STRICT_CUPY_RENDEZVOUS_BYTES`` (default 4 MiB: NCCL's buffer) blocks until the peer posts
the matching receive (MPI synchronous send), smaller ones complete without it. A host
blocked here is what a GPU stream blocked in an NCCL kernel would be: a schedule that
deadlocks hangs here. Several ranks on one GPU: refused (``Duplicate GPU detected``) when
``STRICT_CUPY_NCCL_VERSION`` < 23000 unless ``NCCL_MULTI_RANK_GPU_ENABLE=1`` on >= 2.30.

Streams: with ``STRICT_CUPY_LAZY=1`` every call on a non-default stream is queued and runs
when the stream is waited on (cuda/_lazy.py), reading its buffers then, not at issue.
``STRICT_CUPY_NCCL_STALL=k``: the k-th collective or group call (from 1) never completes, as
a kernel whose peer never comes (its events stay not done) until ``abort()``.
2-byte floats reduce as a ring would: in rank order, rounded to the dtype at every step.
"""
import ctypes as _ctypes
import itertools as _itertools
import os as _os
import struct as _struct

import numpy as _np

from cupy.cuda import _lazy

available = True

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_CHAR, NCCL_INT, NCCL_HALF, NCCL_FLOAT, NCCL_DOUBLE = 0, 2, 6, 7, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
_TAG_JOIN, _TAG_LIST, _TAG_DATA = 32001, 32002, 7
_nonce = _itertools.count(1)
_early = {}
_group = []          # queued ops while a group is open (nesting depth in _depth)
_depth = [0]
_group_stream = [0]  # the stream of the open group's calls
_calls = _itertools.count(1)
_STATS = {"rendezvous_sends": 0, "group_calls": 0, "sends": 0, "destroyed": [], "aborted": []}


class NcclError(RuntimeError):
    pass


def get_version():
    return int(_os.environ.get("STRICT_CUPY_NCCL_VERSION", "22304"))


def get_build_version():
    return get_version()


def _rendezvous_bytes():
    return int(_os.environ.get("STRICT_CUPY_RENDEZVOUS_BYTES", str(4 << 20)))


def _mpi():
    from mpi4py import MPI
    return MPI


def get_unique_id():
    """128 bytes, as CuPy 14 returns (it was a tuple of ints before 14.0)."""
    return _struct.pack("<qq", _mpi().COMM_WORLD.Get_rank(), next(_nonce)).ljust(128, b"\0")


def _np_dtype(dt):
    if dt == NCCL_BFLOAT16:
        import ml_dtypes
        return _np.dtype(ml_dtypes.bfloat16)
    return _np.dtype({NCCL_INT8: _np.int8, NCCL_UINT8: _np.uint8, NCCL_INT32: _np.int32, NCCL_UINT32: _np.uint32,
                     NCCL_INT64: _np.int64, NCCL_UINT64: _np.uint64, NCCL_FLOAT16: _np.float16,
                     NCCL_FLOAT32: _np.float32, NCCL_FLOAT64: _np.float64}[dt])


def _view(ptr, count, dt):
    dt = _np_dtype(dt)
    if count == 0:
        return _np.empty(0, dt)
    raw = (_ctypes.c_char * (count * dt.itemsize)).from_address(ptr)
    return _np.frombuffer(raw, dtype=dt, count=count)


def _mpi_op(op):
    MPI = _mpi()
    return {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX, NCCL_MIN: MPI.MIN, NCCL_AVG: MPI.SUM}[op]


def _reduce_rows(rows, op, n):
    """rows (n, count) of every rank -> their reduction, in rank order. 2-byte floats are
    rounded to their dtype after each addition (as a ring's hops do)."""
    if op in (NCCL_MAX, NCCL_MIN):
        return (_np.max if op == NCCL_MAX else _np.min)(rows, axis=0)
    acc = rows[0].copy()
    for r in rows[1:]:
        acc = (acc * r if op == NCCL_PROD else acc + r).astype(rows.dtype)
    return (acc / n).astype(rows.dtype) if op == NCCL_AVG else acc


def groupStart():
    _depth[0] += 1


def groupEnd():
    _depth[0] -= 1
    if _depth[0]:
        return
    ops, _group[:] = list(_group), []
    if not ops:
        return
    _STATS["group_calls"] += 1

    def post():
        reqs = []
        for nc, kind, ptr, count, dt, peer in ops:     # everything posted at once, buffers read now
            v = _view(ptr, count, dt).view(_np.uint8)
            reqs.append(nc.comm.Irecv(v, source=peer, tag=_TAG_DATA) if kind == "recv"
                        else nc.comm.Isend(v.copy(), dest=peer, tag=_TAG_DATA))
        try:
            _mpi().Request.Waitall(reqs)
        except Exception as e:
            raise NcclError(f"group of {[(k, c, p) for _, k, _, c, _, p in ops]}: {e}") from e
    ops[0][0]._coll(_group_stream[0], post, [(o[2], o[3] * _np_dtype(o[4]).itemsize) for o in ops], grouped=True)


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):
        if not isinstance(commId, bytes) or len(commId) != 128:
            raise TypeError(f"NcclCommunicator: commId must be the 128 bytes of get_unique_id(), "
                            f"got {type(commId).__name__}")
        MPI = _mpi()
        world, me = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
        root, nonce = _struct.unpack("<qq", commId[:16])
        self.nonce = nonce
        if rank == 0:
            members = {0: me}
            for msg in _early.pop(nonce, []):
                members[msg[1]] = msg[2]
            while len(members) < ndev:
                msg = world.recv(source=MPI.ANY_SOURCE, tag=_TAG_JOIN)
                if msg[0] != nonce:
                    _early.setdefault(msg[0], []).append(msg)
                    continue
                members[msg[1]] = msg[2]
            ranks = [members[i] for i in range(ndev)]
            for r in ranks[1:]:
                world.send(ranks, dest=r, tag=_TAG_LIST)
        else:
            world.send((nonce, rank, me), dest=root, tag=_TAG_JOIN)
            ranks = world.recv(source=root, tag=_TAG_LIST)
        self.comm = world.Create_group(world.Get_group().Incl(ranks))
        self._rank, self._size, self._pending, self.ranks, self.aborted = rank, ndev, [], ranks, False
        from cupy.cuda import Device, _current, _n_devices
        devs = self.comm.allgather((MPI.Get_processor_name(), Device(_current[0]).pci_bus_id))
        if len(set(devs)) < len(devs) and not (get_version() >= 23000 and
                                                _os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"):
            raise NcclError(f"ncclInvalidUsage: Duplicate GPU detected : rank {rank} and another rank both "
                            f"on device {_current[0]} (of {_n_devices()})")

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def device_id(self):
        from cupy.cuda import _current
        return _current[0]

    def destroy(self):
        if not self.aborted:
            _lazy.run_until()          # ncclCommDestroy waits for the communicator's queued work
            self._flush()
        _STATS["destroyed"].append(tuple(self.ranks))
        if _os.environ.get("STRICT_CUPY_LOG_DESTROY") == "1":
            print(f"strict_cupy: rank {_mpi().COMM_WORLD.Get_rank()} destroys the communicator of world ranks "
                  f"{self.ranks} (#{self.nonce})", flush=True)

    def abort(self):
        """ncclCommAbort: queued and stalled work is dropped; the events after it complete."""
        self.aborted = True
        _lazy._queue[:] = [q for q in _lazy._queue if getattr(q[1], "nc", None) is not self]
        _STATS["aborted"].append(tuple(self.ranks))

    def check_async_error(self):
        pass

    def _flush(self):
        if self._pending:
            _mpi().Request.Waitall(self._pending)
            self._pending = []

    def _stalls(self):
        return _os.environ.get("STRICT_CUPY_NCCL_STALL") == str(next(_calls))

    # ------------------------------------------------------------ collectives
    def _coll(self, stream, fn, ranges, grouped=False):
        """Run (or queue) one call; ``fn`` reads its buffers when it runs."""
        if _depth[0] and not grouped:
            self._flush()
        fn.nc = self
        if self._stalls():
            fn.stalled = True
        _lazy.enqueue(stream, fn, ranges)

    def _reduced(self, s, op):
        """The reduction of every rank's ``s``: MPI's, or in rank order for 2-byte floats
        (MPI has no bfloat16) and for NCCL_AVG."""
        if s.itemsize != 2 or s.dtype.kind != "f":
            if op != NCCL_AVG:
                out = _np.empty_like(s)
                self.comm.Allreduce(s, out, _mpi_op(op))
                return out
        rows = _np.empty((self._size, s.size), s.dtype)
        self.comm.Allgather(s.view(_np.uint8), rows.view(_np.uint8))
        return _reduce_rows(rows, op, self._size)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        def go():
            _view(recvbuf, count, datatype)[...] = self._reduced(_view(sendbuf, count, datatype).copy(), op)
        nbytes = count * _np_dtype(datatype).itemsize
        self._coll(stream, go, [(sendbuf, nbytes), (recvbuf, nbytes)])

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        def go():
            full = self._reduced(_view(sendbuf, recvcount * self._size, datatype).copy(), op)
            _view(recvbuf, recvcount, datatype)[...] = full[self._rank * recvcount:(self._rank + 1) * recvcount]
        it = _np_dtype(datatype).itemsize
        self._coll(stream, go, [(sendbuf, recvcount * self._size * it), (recvbuf, recvcount * it)])

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        def go():
            s = _view(sendbuf, count, datatype).copy()
            self.comm.Allgather(s.view(_np.uint8), _view(recvbuf, count * self._size, datatype).view(_np.uint8))
        it = _np_dtype(datatype).itemsize
        self._coll(stream, go, [(sendbuf, count * it), (recvbuf, count * self._size * it)])

    def bcast(self, buff, count, datatype, root, stream):
        self._coll(stream, lambda: self.comm.Bcast(_view(buff, count, datatype).view(_np.uint8), root=root),
                   [(buff, count * _np_dtype(datatype).itemsize)])

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        if self._rank == root and sendbuf != recvbuf:
            _view(recvbuf, count, datatype)[...] = _view(sendbuf, count, datatype)
        self.bcast(recvbuf, count, datatype, root, stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        def go():
            full = self._reduced(_view(sendbuf, count, datatype).copy(), op)
            if self._rank == root:
                _view(recvbuf, count, datatype)[...] = full
        nbytes = count * _np_dtype(datatype).itemsize
        self._coll(stream, go, [(sendbuf, nbytes), (recvbuf, nbytes)])

    # ------------------------------------------------------- point-to-point
    def _check_peer(self, peer):
        if not 0 <= peer < self._size:
            raise NcclError(f"ncclInvalidArgument: peer {peer} of a communicator of {self._size}")
        if peer == self._rank:
            raise NcclError("ncclInvalidUsage: send/recv to self is not supported by this stand-in "
                            "(pdist copies self-messages locally)")

    def send(self, sendbuf, count, datatype, peer, stream):
        self._check_peer(peer)
        _STATS["sends"] += 1
        if _depth[0]:
            _group_stream[0] = stream
            _group.append((self, "send", sendbuf, count, datatype, peer))
            return

        def go():
            v = _view(sendbuf, count, datatype).view(_np.uint8)
            if v.nbytes > _rendezvous_bytes():
                _STATS["rendezvous_sends"] += 1
                self.comm.Ssend(v, dest=peer, tag=_TAG_DATA)        # blocks until the receive is posted
            else:
                self._pending = [q for q in self._pending if not q.Test()]
                self._pending.append(self.comm.Issend(v.copy(), dest=peer, tag=_TAG_DATA))
        self._coll(stream, go, [(sendbuf, count * _np_dtype(datatype).itemsize)])

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._check_peer(peer)
        if _depth[0]:
            _group_stream[0] = stream
            _group.append((self, "recv", recvbuf, count, datatype, peer))
            return
        self._coll(stream, lambda: self.comm.Recv(_view(recvbuf, count, datatype).view(_np.uint8), source=peer,
                                                  tag=_TAG_DATA),
                   [(recvbuf, count * _np_dtype(datatype).itemsize)])
