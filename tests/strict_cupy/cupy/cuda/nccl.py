"""cupy.cuda.nccl stand-in: NCCL's API and semantics emulated over MPI on the host.

Buffers are device pointers (``a.data.ptr``), as in NCCL; the emulation reads and
writes the memory behind them. Semantics kept: a communicator is created by the
``ndev`` ranks that share a unique id (collective over those ranks only); point-to-
point messages carry no tag and match in issue order; between ``groupStart`` and
``groupEnd`` operations are only queued, and ``groupEnd`` posts them all at once and
returns when all are done; a lone ``send`` of more than ``STRICT_CUPY_RENDEZVOUS_BYTES``
(default 4 MiB: NCCL's buffer) blocks until the peer posts the matching receive (MPI
synchronous send), smaller ones complete without it. A host blocked here is what a
GPU stream blocked in an NCCL kernel would be: a schedule that deadlocks hangs here.
Several ranks on one GPU: refused (``Duplicate GPU detected``) when
``STRICT_CUPY_NCCL_VERSION`` < 23000 unless ``NCCL_MULTI_RANK_GPU_ENABLE=1`` on >= 2.30.
"""
import ctypes
import itertools
import os

import numpy as np

available = True

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
_DT = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
       NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32,
       NCCL_FLOAT64: np.float64}
_TAG_JOIN, _TAG_LIST, _TAG_DATA = 32001, 32002, 7
_nonce = itertools.count(1)
_early = {}
_group = []          # queued ops while a group is open (nesting depth in _depth)
_depth = [0]
STATS = {"rendezvous_sends": 0, "group_calls": 0, "sends": 0}


class NcclError(RuntimeError):
    pass


def get_version():
    return int(os.environ.get("STRICT_CUPY_NCCL_VERSION", "22304"))


def get_build_version():
    return get_version()


def _rendezvous_bytes():
    return int(os.environ.get("STRICT_CUPY_RENDEZVOUS_BYTES", str(4 << 20)))


def _mpi():
    from mpi4py import MPI
    return MPI


def get_unique_id():
    return (_mpi().COMM_WORLD.Get_rank(), next(_nonce)) + (0,) * 126


def _view(ptr, count, dt):
    dt = np.dtype(_DT[dt])
    if count == 0:
        return np.empty(0, dt)
    raw = (ctypes.c_char * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dt, count=count)


def _mpi_op(op):
    MPI = _mpi()
    return {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX, NCCL_MIN: MPI.MIN}[op]


def groupStart():
    _depth[0] += 1


def groupEnd():
    _depth[0] -= 1
    if _depth[0]:
        return
    ops, _group[:] = list(_group), []
    STATS["group_calls"] += 1
    reqs = []
    for comm, kind, view, peer in ops:                  # everything posted at once
        if kind == "recv":
            reqs.append(comm.Irecv(view, source=peer, tag=_TAG_DATA))
        else:
            reqs.append(comm.Isend(view, dest=peer, tag=_TAG_DATA))
    try:
        _mpi().Request.Waitall(reqs)
    except Exception as e:
        raise NcclError(f"group of {[(k, v.nbytes, p) for _, k, v, p in ops]}: {e}") from e


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):
        MPI = _mpi()
        world, me = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
        root, nonce = commId[0], commId[1]
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
        self._rank, self._size, self._pending = rank, ndev, []
        from cupy.cuda import _current, _n_devices
        devs = self.comm.allgather((MPI.Get_processor_name(), _current[0]))
        if len(set(devs)) < len(devs) and not (get_version() >= 23000 and
                                                os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"):
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
        self._flush()

    abort = destroy

    def _flush(self):
        if self._pending:
            _mpi().Request.Waitall(self._pending)
            self._pending = []

    # ------------------------------------------------------------ collectives
    def _coll(self, fn):
        if _depth[0]:
            self._flush()
        fn()

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        s, r = _view(sendbuf, count, datatype), _view(recvbuf, count, datatype)
        self._coll(lambda: self.comm.Allreduce(_mpi().IN_PLACE if sendbuf == recvbuf else s, r, _mpi_op(op)))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        s = _view(sendbuf, recvcount * self._size, datatype).copy()
        r = _view(recvbuf, recvcount, datatype)
        self._coll(lambda: self.comm.Reduce_scatter_block(s, r, _mpi_op(op)))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        s = _view(sendbuf, count, datatype).copy()
        r = _view(recvbuf, count * self._size, datatype)
        self._coll(lambda: self.comm.Allgather(s, r))

    def bcast(self, buff, count, datatype, root, stream):
        self._coll(lambda: self.comm.Bcast(_view(buff, count, datatype), root=root))

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        r = _view(recvbuf, count, datatype)
        if self._rank == root and sendbuf != recvbuf:
            r[...] = _view(sendbuf, count, datatype)
        self.bcast(recvbuf, count, datatype, root, stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        s = _view(sendbuf, count, datatype).copy()
        r = _view(recvbuf, count, datatype) if self._rank == root else None
        self._coll(lambda: self.comm.Reduce(s, r, _mpi_op(op), root=root))

    # ------------------------------------------------------- point-to-point
    def _check_peer(self, peer):
        if not 0 <= peer < self._size:
            raise NcclError(f"ncclInvalidArgument: peer {peer} of a communicator of {self._size}")
        if peer == self._rank:
            raise NcclError("ncclInvalidUsage: send/recv to self is not supported by this stand-in "
                            "(pdist copies self-messages locally)")

    def send(self, sendbuf, count, datatype, peer, stream):
        self._check_peer(peer)
        v = _view(sendbuf, count, datatype)
        STATS["sends"] += 1
        if _depth[0]:
            _group.append((self.comm, "send", v.copy(), peer))
        elif v.nbytes > _rendezvous_bytes():
            STATS["rendezvous_sends"] += 1
            self.comm.Ssend(v, dest=peer, tag=_TAG_DATA)        # blocks until the receive is posted
        else:
            self._pending = [q for q in self._pending if not q.Test()]
            self._pending.append(self.comm.Issend(v.copy(), dest=peer, tag=_TAG_DATA))

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._check_peer(peer)
        v = _view(recvbuf, count, datatype)
        if _depth[0]:
            _group.append((self.comm, "recv", v, peer))
        else:
            self.comm.Recv(v, source=peer, tag=_TAG_DATA)
