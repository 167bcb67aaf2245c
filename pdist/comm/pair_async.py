"""Two ranks, a small async all-reduce: the payload rides on its check's message, from a pool
of persistent requests (DDP's small buckets, issued during backward and waited on after it).

Math. As in pair.py, rank r sends m_r = [ f_r | p_r | x_r ] (f: the fingerprint, with
async_op = 1; p: the payload's byte count), receives m_q, and ``wait()`` checks
[f_q | p_q] == [f_r | p_r] before it reduces x <- x_r (op) x_q: one message each way, the
bits of MPI's two-rank Allreduce. Several may be in flight at once (a DDP backward issues a
bucket as soon as its last gradient is written), so each op takes a *channel* of its own: a
send buffer of its size, a receive buffer of the largest message (header + ``SMALL_BYTES``,
so a mismatched message never truncates) and their persistent requests
(MPI_Send_init/MPI_Recv_init). A finished op gives its channel back to its slot's pool, so a
training loop allocates nothing after its first step. Receives are matched in the order they
were posted (MPI's non-overtaking rule for one pair, communicator and tag), and both ranks
post them in issue order, so the k-th op's receive gets the partner's k-th message whatever
channel holds it.

Larger calls. An async all-reduce of more than ``SMALL_BYTES`` sends [f_r | 0] (the header
alone, the general path's message) on a channel without a payload and posts MPI's
``Iallreduce`` on the group's data communicator; ``wait()`` judges the header, then waits for
the data. It skips only the general path's Python (group.py ``_run_op``).

Lifetime. A channel whose requests may still be active (an exception after they started, a
wait that timed out, a mismatch) is never reused: it stays referenced (the op's ``Pending``,
or the group's orphans) so MPI never writes into freed memory. The check, the flight record,
the dropped-handle report and the ``blocked`` intervals are those of every async collective
(work.py), so a rank in this path and a rank in any other call still meet and raise the same
CollectiveMismatchError.
"""
import numpy as np

from pdist.comm.check import K
from pdist.comm.flight_recorder import _cur
from pdist.comm.mpi import MPI, wait_all
from pdist.comm.mpi_collectives import REDUCE_OPS
from pdist.comm.pair import HEAD, SMALL_BYTES, TAG, message, post
from pdist.comm.work import Pending, Work
from pdist.measure import blocked

POOL = 16                        # idle channels kept per (dtype, shape)


class Channel:
    """One in-flight op's buffers, header views and persistent requests."""
    __slots__ = ("sbuf", "rbuf", "sview", "rview", "shead", "rhead", "reqs")

    def __init__(self, pair, buf, head):
        """``buf``: the payload's dtype and shape (None: the header alone, a call of more than
        SMALL_BYTES); ``head``: its slot's packed header."""
        n = 0 if buf is None else buf.nbytes
        self.sbuf, self.shead, self.sview = message(head, buf)
        self.rbuf = np.empty(HEAD + SMALL_BYTES, np.uint8)
        self.rview = None if buf is None else self.rbuf[HEAD:HEAD + n].view(buf.dtype).reshape(buf.shape)
        self.rhead = memoryview(self.rbuf)[:HEAD].cast("q")
        self.reqs = [pair.comm.Recv_init(self.rbuf, pair.peer, TAG), pair.comm.Send_init(self.sbuf, pair.peer, TAG)]


def all_reduce_async(pair, g, buf, op, slot):
    """buf <- buf_r (op) buf_q once ``wait()`` returns (module doc); ``slot``: the fused call's
    (pair.PairCheck.fused), whose pool of idle channels this op draws from. A call of more
    than SMALL_BYTES sends the header alone on its channel and its data by MPI's Iallreduce
    on the group's data communicator, as the general path does."""
    rec = blocked.ON[0]
    t_in = blocked.enter() if rec else 0.0
    n, ufunc, avg, args, free = slot[0], slot[4], slot[5], slot[6], slot[8]
    big = n > SMALL_BYTES
    ch = free.pop() if free else Channel(pair, None if big else buf, slot[9])
    try:
        ent, seq, t0 = post(pair, g, ch.shead, ch.sview, buf, ch.reqs, n)
        data = [g._mpi.comm.Iallreduce(MPI.IN_PLACE, buf, REDUCE_OPS[op])] if big else None
        work = _work(pair, g, buf, op, (ch, free, ufunc, avg), ent, ("all_reduce", t0, args) if t0 else None, data)
    except BaseException:
        g._orphans.append(ch)                  # its requests are active: MPI still writes to it
        raise
    finally:
        if rec:
            blocked.leave("c", g, t_in, g._seq)
    if rec:
        work._wf = ("w", g, seq)
    return work


def _work(pair, g, buf, op, how, ent, span, data):
    """The op's Work and the group's Pending record: ``check`` (run by ``wait()`` or the next
    collective) waits for the header and judges it (the small call's payload came with it);
    ``then`` reduces the small call's payload (the big one's MPI reduced) and scales an avg.
    ``how``: (channel, its slot's idle channels, ufunc, avg)."""
    ch, free, ufunc, avg = how
    reqs, rview = ch.reqs, ch.rview

    def check():
        wait_all(reqs)
        if ch.shead != ch.rhead:
            pair.judge(g, list(ch.shead[:K]), None, lambda: (str(buf.dtype), f"size={buf.size} dtype={buf.dtype} "
                                                             f"op={op} root=-1 algorithm=mpi async_op=True"), ch.rbuf)
        if data is not None and len(free) < POOL:
            free.append(ch)                    # the header is all a big call's channel holds
    check.ready = lambda: MPI.Request.Testall(reqs)

    def then():                                # after the check passed (Work._finish)
        if data is None:
            ufunc(buf, rview, buf)
        if avg:
            np.multiply(buf, 0.5, out=buf)     # == buf / 2, bit for bit
        if data is None and len(free) < POOL:
            free.append(ch)

    wait = _nothing if data is None else (lambda: wait_all(data))
    work = Work(wait=wait, test=check.ready if data is None else (lambda: MPI.Request.Testall(data)), then=then,
                keep=(buf, ch), span=span)
    work._pending = p = Pending(check, wait, work._keep, ent, g)
    g._pending.append(p)
    _cur[0] = None
    return work


def _nothing():
    return None


__all__ = ["all_reduce_async", "Channel", "POOL"]
