"""Device arrays over MPI, staged through the host: device -> host, MPI on the NumPy copy,
host -> device. The transport where NCCL can't serve: several ranks on one GPU with NCCL
<= 2.29, or ``PDIST_GPU_TRANSPORT=mpi-host`` (gpu_transport.choose_transport decides)."""
from pdist.engine.backend import array_module, to_numpy
from pdist.comm.work import Work


def _to_host(a):
    return to_numpy(a)


def _to_device(dst, host):
    dst[...] = array_module(dst).asarray(host)


class MPIHostBackend:
    """Device arrays over MPI, staged through the host: device -> host, MPI on the NumPy
    copy, host -> device. The transport where NCCL can't serve (several ranks on one GPU
    with NCCL <= 2.29, or ``PDIST_GPU_TRANSPORT=mpi-host``). Same methods as
    MPICollectives; ``async_op`` ops stay non-blocking (the copy back runs in wait())."""

    def __init__(self, mpi_comm):
        from pdist.comm.mpi import MPIP2P
        from pdist.comm.mpi_collectives import MPICollectives
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.mpi = MPICollectives(mpi_comm.Dup())
        self.user = MPICollectives(mpi_comm.Dup())
        self.p2p = MPIHostP2P(MPIP2P(mpi_comm.Dup()))

    verified = property(lambda self: self.mpi.verified,
                        lambda self, v: setattr(self.mpi, "verified", v))

    @staticmethod
    def _staged(work, back):
        if work is None:
            back()
            return None
        return Work(wait=lambda: (work._wait(), back()), test=work._test, keep=work._keep)

    def all_reduce(self, buf, op, nb=False):
        h = _to_host(buf)
        return self._staged(self.mpi.all_reduce(h, op, nb), lambda: _to_device(buf, h))

    def reduce_scatter(self, out, inp, counts, op, nb=False):
        h, ho = _to_host(inp), _to_host(out)
        return self._staged(self.mpi.reduce_scatter(ho, h, counts, op, nb), lambda: _to_device(out, ho))

    def all_gather(self, out, inp, counts, nb=False):
        h, ho = _to_host(inp), _to_host(out)
        return self._staged(self.mpi.all_gather(ho, h, counts, nb), lambda: _to_device(out, ho))

    def broadcast(self, buf, src, nb=False):
        h = _to_host(buf)
        return self._staged(self.mpi.broadcast(h, src, nb), lambda: _to_device(buf, h))

    def reduce(self, buf, dst, op, nb=False):
        h = _to_host(buf)
        return self._staged(self.mpi.reduce(h, dst, op, nb),
                            lambda: _to_device(buf, h) if self.rank == dst else None)

    def all_to_all(self, out, inp, nb=False):
        h, ho = _to_host(inp), _to_host(out)
        return self._staged(self.mpi.all_to_all(ho, h, nb), lambda: _to_device(out, ho))

    def barrier(self, nb=False):
        return self.mpi.barrier(nb)

    def isend(self, buf, dst, tag=0):
        self.p2p.wire_bytes += buf.nbytes
        return self.user.isend(_to_host(buf), dst, tag)

    def irecv(self, buf, src, tag=0):
        h = _to_host(buf)
        return self._staged(self.user.irecv(h, src, tag), lambda: _to_device(buf, h))


class MPIHostP2P:
    """The hand-built algorithms' transport for device arrays over MPI (host copies)."""

    def __init__(self, mpi_p2p):
        self.t, self.rank, self.size, self.wire_bytes = mpi_p2p, mpi_p2p.rank, mpi_p2p.size, 0

    def send(self, buf, dst, tag=0):
        self.wire_bytes += buf.nbytes
        self.t.send(_to_host(buf), dst, tag)

    def recv(self, buf, src, tag=0):
        h = _to_host(buf)
        self.t.recv(h, src, tag)
        _to_device(buf, h)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        self.wire_bytes += sendbuf.nbytes
        h = _to_host(recvbuf)
        self.t.sendrecv(_to_host(sendbuf), dst, h, src, tag)
        _to_device(recvbuf, h)

    def sendrecv_iter(self, sendbuf, dst, recvbuf, src, tag=0):
        self.sendrecv(sendbuf, dst, recvbuf, src, tag)
        yield 0, recvbuf.size
