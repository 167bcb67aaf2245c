"""MPI's collectives on NumPy buffers, each issued non-blocking and finished by ``wait_all``
(pdist/comm/mpi.py: deadlines, cooperative waits), after the fingerprint check of
pdist/comm/check.py has shown every rank to be in the same call.
"""
from pdist.comm import low_precision
from pdist.comm.mpi import MPI, _state, check_count, wait_all
from pdist.comm.work import Work
from pdist.engine.backend import is_low, words


REDUCE_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _typed(buf, counts=None):
    """mpi4py buffer spec with an explicit MPI datatype (and counts/displs)."""
    from mpi4py.util.dtlib import from_numpy_dtype
    t = from_numpy_dtype(buf.dtype)
    if counts is None:
        return [buf, t]
    displs = [0] * len(counts)
    for i in range(1, len(counts)):
        displs[i] = displs[i - 1] + counts[i - 1]
    return [buf, (counts, displs), t]


class MPICollectives:
    """MPI's own collectives on flat NumPy buffers (algorithm ``"mpi"``).

    Each method issues the non-blocking call and finishes it with ``wait_all``
    (which has a deadline, see above); with ``nb=True`` it returns a pending
    ``Work`` instead. One exception, the fast path: when the group has just
    verified that every rank is in this very collective (``verified``: the
    fingerprint check passed) and waits are not cooperative, MPI's blocking
    call runs. It cannot wait for a missing rank; a rank that dies meanwhile
    ends the job (SIGKILL: the launcher; an exception: its failure hook)."""

    def __init__(self, comm):
        self.comm = comm
        self.verified = False        # set by the group just before each call

    def _go(self, blocking, nonblocking, nb):
        if nb:
            reqs = nonblocking()
            return Work(wait=lambda: wait_all(reqs), test=lambda: MPI.Request.Testall(reqs))
        if self.verified and not _state["cooperative"]:
            blocking()
        else:
            wait_all(nonblocking())
        return None

    def _low(self, wait, nb):
        """A two-phase reduction of 2-byte floats (low_precision.py), as a Work or run now."""
        if not nb:
            return wait()
        return Work(wait=wait, test=lambda: bool(wait.ready()) and (wait() or True))

    def all_reduce(self, buf, op, nb=False):
        if is_low(buf.dtype):
            return self._low(low_precision.all_reduce(self.comm, buf, op, wait_all), nb)
        c, o = self.comm, REDUCE_OPS[op]
        return self._go(lambda: c.Allreduce(MPI.IN_PLACE, buf, o),
                        lambda: [c.Iallreduce(MPI.IN_PLACE, buf, o)], nb)

    def reduce_scatter(self, out, inp, counts, op, nb=False):
        if is_low(inp.dtype):
            return self._low(low_precision.reduce_scatter(self.comm, out, inp, counts, op, wait_all), nb)
        c, o = self.comm, REDUCE_OPS[op]
        if len(set(counts)) == 1:
            return self._go(lambda: c.Reduce_scatter_block(inp, out, o),
                            lambda: [c.Ireduce_scatter_block(inp, out, o)], nb)
        return self._go(lambda: c.Reduce_scatter(inp, out, counts, o),
                        lambda: [c.Ireduce_scatter(inp, out, counts, o)], nb)

    def all_gather(self, out, inp, counts, nb=False):
        c, out, inp = self.comm, words(out), words(inp)
        if len(set(counts)) == 1:
            return self._go(lambda: c.Allgather(inp, out), lambda: [c.Iallgather(inp, out)], nb)
        spec = _typed(out, list(counts))
        return self._go(lambda: c.Allgatherv(inp, spec), lambda: [c.Iallgatherv(inp, spec)], nb)

    def broadcast(self, buf, src, nb=False):
        c, buf = self.comm, words(buf)
        return self._go(lambda: c.Bcast(buf, src), lambda: [c.Ibcast(buf, src)], nb)

    def reduce(self, buf, dst, op, nb=False):
        if is_low(buf.dtype):
            return self._low(low_precision.reduce(self.comm, buf, dst, op, wait_all), nb)
        c, o = self.comm, REDUCE_OPS[op]
        send, recv = (MPI.IN_PLACE, buf) if c.Get_rank() == dst else (buf, None)
        return self._go(lambda: c.Reduce(send, recv, o, dst), lambda: [c.Ireduce(send, recv, o, dst)], nb)

    def all_to_all(self, out, inp, nb=False):
        c, out, inp = self.comm, words(out), words(inp)
        return self._go(lambda: c.Alltoall(inp, out), lambda: [c.Ialltoall(inp, out)], nb)

    def all_to_all_v(self, out, inp, send_counts, recv_counts, nb=False):
        """Alltoallv; counts in elements of the flat buffers."""
        c = self.comm
        si, so = _typed(words(inp), list(send_counts)), _typed(words(out), list(recv_counts))
        return self._go(lambda: c.Alltoallv(si, so), lambda: [c.Ialltoallv(si, so)], nb)

    def barrier(self, nb=False):
        c = self.comm
        return self._go(c.Barrier, lambda: [c.Ibarrier()], nb)

    def isend(self, buf, dst, tag):
        req = self.comm.Isend(buf, dst, tag)
        return Work(wait=lambda: wait_all([req]), test=req.Test, keep=(buf,))

    def irecv(self, buf, src, tag):
        req, status = self.comm.Irecv(buf, src, tag), MPI.Status()

        def wait():
            wait_all([req], [status])
            check_count(status, buf)
        return Work(wait=wait, test=lambda: req.Test(status) and (check_count(status, buf) or True),
                    keep=(buf,))


__all__ = ["MPICollectives", "REDUCE_OPS"]
