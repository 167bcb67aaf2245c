"""Device arrays over MPI, staged through the host: device -> host, MPI on the NumPy copy,
host -> device. The transport where NCCL can't serve: several ranks on one GPU with NCCL
<= 2.29, or ``PDIST_GPU_TRANSPORT=mpi-host`` (gpu_transport.choose_transport decides).

The host copies are page-locked (``cupyx.empty_pinned``, from CuPy's pinned memory pool):
the copies to and from them run at the bus's speed, not through a bounce buffer. The copy
back to the device is the Work's finishing step (work.py: ``finish``), run by ``wait()`` or
by the ``is_completed()`` that finds the data arrived, so DDP's polling of its buckets
finds the reduced gradients on the device."""
from pdist.engine.backend import array_module, guard_host_read, is_device_array, words
from pdist.comm.work import Work


def _pinned(a):
    """An empty page-locked host array of ``a``'s shape and dtype (NumPy for a NumPy ``a``)."""
    xp = array_module(a)
    if xp.__name__ == "numpy":
        return xp.empty_like(a)
    import cupyx
    return cupyx.empty_pinned(a.shape, a.dtype)


def _to_host(a):
    """``a``'s values in a pinned host array, after the device's work so far (waited for under
    the deadline: backend.guard_host_read)."""
    if not is_device_array(a):
        return a.copy()
    guard_host_read()
    return a.get(out=_pinned(a))


def _to_device(dst, host):
    if is_device_array(dst):
        dst.set(host.reshape(dst.shape))
    else:
        dst[...] = host


class MPIHostBackend:
    """Device arrays over MPI, staged through the host: device -> host, MPI on the NumPy
    copy, host -> device. The transport where NCCL can't serve (several ranks on one GPU
    with NCCL <= 2.29, or ``PDIST_GPU_TRANSPORT=mpi-host``). Same methods as
    MPICollectives; ``async_op`` ops stay non-blocking (the copy back is their finishing
    step). The user's send/recv (``user_p2p``) and isend/irecv share one communicator, so
    a send matches an irecv; the hand-built algorithms (``p2p``) have their own."""
    kind = "mpi-host"

    def __init__(self, mpi_comm):
        from pdist.comm.mpi import MPIP2P
        from pdist.comm.mpi_collectives import MPICollectives
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.mpi = MPICollectives(mpi_comm.Dup())
        user = mpi_comm.Dup()
        self.user = MPICollectives(user)
        self.user_p2p = MPIHostP2P(MPIP2P(user))
        self.p2p = MPIHostP2P(MPIP2P(mpi_comm.Dup()))

    verified = property(lambda self: self.mpi.verified,
                        lambda self, v: setattr(self.mpi, "verified", v))

    @staticmethod
    def _staged(work, back):
        if work is None:
            back()
            return None
        return Work(wait=work._wait, test=work._test, keep=work._keep, finish=back)

    def all_reduce(self, buf, op, nb=False):
        h = _to_host(buf)
        return self._staged(self.mpi.all_reduce(h, op, nb), lambda: _to_device(buf, h))

    def reduce_scatter(self, out, inp, counts, op, nb=False):
        h, ho = _to_host(inp), _pinned(out)
        return self._staged(self.mpi.reduce_scatter(ho, h, counts, op, nb), lambda: _to_device(out, ho))

    def all_gather(self, out, inp, counts, nb=False):
        h, ho = _to_host(inp), _pinned(out)
        return self._staged(self.mpi.all_gather(ho, h, counts, nb), lambda: _to_device(out, ho))

    def broadcast(self, buf, src, nb=False):
        h = _to_host(buf)
        return self._staged(self.mpi.broadcast(h, src, nb), lambda: _to_device(buf, h))

    def reduce(self, buf, dst, op, nb=False):
        h = _to_host(buf)
        return self._staged(self.mpi.reduce(h, dst, op, nb),
                            lambda: _to_device(buf, h) if self.rank == dst else None)

    def all_to_all(self, out, inp, nb=False):
        h, ho = _to_host(inp), _pinned(out)
        return self._staged(self.mpi.all_to_all(ho, h, nb), lambda: _to_device(out, ho))

    def all_to_all_v(self, out, inp, send_counts, recv_counts, nb=False):
        h, ho = _to_host(inp), _pinned(out)
        return self._staged(self.mpi.all_to_all_v(ho, h, send_counts, recv_counts, nb),
                            lambda: _to_device(out, ho))

    def barrier(self, nb=False):
        return self.mpi.barrier(nb)

    def isend(self, buf, dst, tag=0):
        self.p2p.wire_bytes += buf.nbytes
        return self.user.isend(words(_to_host(buf)), dst, tag)      # 2-byte floats as raw words

    def irecv(self, buf, src, tag=0):
        h = _pinned(buf)
        return self._staged(self.user.irecv(words(h), src, tag), lambda: _to_device(buf, h))


class MPIHostP2P:
    """Point-to-point for device arrays over MPI (host copies): the hand-built algorithms'
    transport, and the user's send/recv."""

    def __init__(self, mpi_p2p):
        self.t, self.rank, self.size, self.wire_bytes = mpi_p2p, mpi_p2p.rank, mpi_p2p.size, 0

    def send(self, buf, dst, tag=0):
        self.wire_bytes += buf.nbytes
        self.t.send(words(_to_host(buf)), dst, tag)

    def recv(self, buf, src, tag=0):
        h = _pinned(buf)
        self.t.recv(words(h), src, tag)
        _to_device(buf, h)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        self.wire_bytes += sendbuf.nbytes
        h = _pinned(recvbuf)
        self.t.sendrecv(words(_to_host(sendbuf)), dst, words(h), src, tag)
        _to_device(recvbuf, h)

    def sendrecv_iter(self, sendbuf, dst, recvbuf, src, tag=0):
        self.sendrecv(sendbuf, dst, recvbuf, src, tag)
        yield 0, recvbuf.size
