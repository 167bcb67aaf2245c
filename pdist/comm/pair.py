"""Two-rank groups: the collective check as one exchange, and the small all-reduce that
carries its check in the same message (the fingerprint rides on the payload).

Math. In a group of two ranks r and q = 1 - r, the check of check.py (max f == min f over
the ranks' fingerprints f) is f_r == f_q: one exchange of f, compared on both sides. An
all-reduce of two ranks is one exchange too, x <- x_r (op) x_q. So a small all-reduce sends

    m_r = [ f_r (11 int64) | p_r (1 int64) | x_r (the payload's bytes) ]     (header: 96 bytes)

(p_r: the payload's byte count, 0 when the message carries none), receives m_q, checks
[f_q | p_q] == [f_r | p_r] (bytewise) and reduces. IEEE addition, max and min are
commutative (x_0 + x_1 == x_1 + x_0, bit for bit), so both ranks hold the same bits, the
bits of MPI's own two-rank Allreduce (one addition; Thakur, Rabenseifner & Gropp 2005,
"Optimization of collective communication operations in MPICH": recursive doubling, one
step at n = 2). One message each way instead of a checked call's two all-reduces.

Every check of a two-rank group is this exchange (``check.agree`` / ``agree_start``), with
or without a payload, point-to-point on the group's fingerprint communicator. So a rank
in the fused all-reduce and a rank in any other collective still meet, see the fields they
disagree on (op, seq, size, dtype, ...) and raise the same CollectiveMismatchError; the
receive buffer holds the largest message (header + ``SMALL_BYTES``), so MPI never
truncates one. Messages match in issue order (MPI's non-overtaking rule for one pair,
communicator and tag). Whether a call is fused is decided by its fingerprint alone
(op all_reduce, blocking, algorithm "mpi", payload <= ``SMALL_BYTES``, a NumPy dtype of
``FUSED``, no local error): equal headers mean both ranks fused, or neither did. (The one
exception, a NumPy array on one rank and a device array on the other, shows in p: one
rank's is 0, and both ranks refuse it.) With the check off (``pg.check = False``) the small
call takes the same one-message path and skips only the comparison: the cheapest way to
move it either way (MPI's own Iallreduce, which a checks-off call would otherwise take for
its deadline, is the slower one at 8 B: docs/collectives.md).

Never a hang: the exchange is non-blocking requests finished by ``mpi.wait_all`` (the
watchdog's deadline and control channel). Cost: each (dtype, shape, op) has a slot with a
message of its own, its header packed once (a call writes seq, step and batch, and its
payload) and persistent requests (MPI_Send_init, MPI_Recv_init), so a blocking call
allocates nothing; an async one takes a pooled channel of its own, which starts from its
slot's header (pair_async.py: several may be in flight).
The blocking call sends first and writes its flight record and byte count while the
partner's message travels. See bench/collectives.py's latency table ("mpi" beside "raw").
"""
import struct
from time import time

import numpy as np

from pdist.comm.check import K, _ALG, _OP, _RED, _verdict, dtype_code
from pdist.comm.flight_recorder import ON_ENTER, Entry, _batch, _cur, _flight, _step
from pdist.comm.mpi import MPI, wait_all
from pdist.measure import blocked, trace
from pdist.measure.trace import _cfg as _trace_on    # {"on": ...}: record a span only when tracing

SMALL_BYTES = 65536                # payloads up to this many bytes ride with the fingerprint
HEAD = 8 * (K + 1)                 # the fingerprint and the payload's length, at the front of every message
TAG = 3
_HEAD = struct.Struct(f"={K + 1}q")  # native order, 8 bytes per field, no padding
FUSED = frozenset(np.dtype(t) for t in ("float32", "float64", "int8", "int16", "int32", "int64",
                                        "uint8", "uint16", "uint32", "uint64"))
_UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}
_AR, _MPI_ALG = _OP["all_reduce"], _ALG["mpi"]
_UNSEEN = object()


class PairCheck:
    """The check channel of a two-rank group (``ProcessGroup._pair``), and its fused
    small all-reduce."""

    def __init__(self, group):
        self.comm, self.peer, self.name = group._fp, 1 - group.rank, group.name
        self.sbuf = np.zeros(HEAD, np.uint8)                      # a check's message: the header alone
        self.rbuf = np.zeros(HEAD + SMALL_BYTES, np.uint8)        # (HEAD + SMALL_BYTES,) bytes: the largest
        # the headers as int64 views: comparing 12 items is ~8x cheaper than 96 bytes ('B')
        self.shead, self.rhead = (memoryview(b)[:HEAD].cast("q") for b in (self.sbuf, self.rbuf))
        self._requests()
        self.calls = self.nbytes = 0           # fused calls and their bytes, not yet in the group's stats

    def _requests(self):
        """Fresh persistent requests and slots (also after a wait that raised: the old ones
        may still be active, and the slots hold their own sends)."""
        self.recv = self.comm.Recv_init(self.rbuf, self.peer, TAG)
        self.send = self.comm.Send_init(self.sbuf, self.peer, TAG)
        self.slots = {}                        # fused()'s key -> slot (or None: not fused)

    def _exchange(self, fp):
        """Send [fp | 0] (no payload), receive the partner's message; True when its header
        equals ours (a partner that fused an equal call sends a non-zero payload length)."""
        _HEAD.pack_into(self.sbuf, 0, *fp, 0)
        reqs = [self.recv, self.send]
        MPI.Prequest.Startall(reqs)
        try:
            wait_all(reqs)
        except BaseException:
            self._requests()                   # the old ones may still be active
            raise
        return self.shead == self.rhead

    def judge(self, g, fp, error, describe, rbuf):
        """Raise the group's CollectiveMismatchError on both ranks unless the partner's
        header (at the front of ``rbuf``) equals ``fp`` and neither rank has an error."""
        theirs = _HEAD.unpack_from(rbuf, 0)[:K]
        if list(theirs) == fp and not error:   # equal fingerprints, one payload fused and one not
            error = ("one rank's all_reduce carried its payload in the check (a NumPy array of <= "
                     f"{SMALL_BYTES} bytes), the other's did not: pass the same kind of array (NumPy or "
                     "device) on every rank")
            fp = fp[:-1] + [1]
        res = [max(a, b) for a, b in zip(fp, theirs)] + [-min(a, b) for a, b in zip(fp, theirs)]
        _verdict(g, fp, error, describe, res)

    def agree(self, g, fp, error, describe):
        """check.agree for two ranks: one header exchange."""
        if not self._exchange(fp) or error:
            self.judge(g, fp, error, describe, self.rbuf)

    def start(self, g, fp, error, describe):
        """check.agree_start for two ranks: the exchange posted now, judged by ``finish()``."""
        send, recv = np.array(fp + [0], np.int64).view(np.uint8), np.empty(HEAD + SMALL_BYTES, np.uint8)
        reqs = [self.comm.Irecv(recv, self.peer, TAG), self.comm.Isend(send, self.peer, TAG)]

        def finish():
            wait_all(reqs)
            if error or recv[:HEAD].tobytes() != send[:HEAD].tobytes():
                self.judge(g, fp, error, describe, recv)
        finish.ready = lambda: MPI.Request.Testall(reqs)
        return finish

    # ------------------------------------------------------ the fused all-reduce
    def fused(self, g, buf, op, algorithm, async_op=False):
        """This all_reduce's slot (``_slot``) when it is fused, else None; ``async_op``: an async
        call with its check on, whose slot may exceed ``SMALL_BYTES`` (its data then goes by
        MPI's Iallreduce, pair_async.py). Only its fingerprint's fields decide, and the group's
        own state (no simulated link; the algorithm given, or the group's default), the same
        on both ranks. The verdict is cached per (dtype, shape, strides, op, algorithm,
        async_op), the None of a call that is not fused too."""
        if type(buf) is not np.ndarray or g._link is not None:
            return None
        key = (buf.dtype, buf.shape, buf.strides, op, algorithm or g.default_algorithm, async_op)
        s = self.slots.get(key, _UNSEEN)
        if s is _UNSEEN:
            if len(self.slots) >= 256:
                self.slots.clear()
            s = self.slots[key] = self._decide(buf, op, key[4], async_op)
        return s

    def _decide(self, buf, op, algorithm, async_op):
        if op not in _UFUNC or algorithm != "mpi" or buf.dtype not in FUSED or not buf.flags.c_contiguous:
            return None
        if op == "avg" and buf.dtype.kind != "f":
            return None
        if buf.nbytes > SMALL_BYTES and not async_op:
            return None
        return self._slot(buf, op, async_op)

    def _slot(self, buf, op, async_op):
        """(n, send view, receive view, send header, ufunc, avg, trace args, requests, idle
        channels, header): a blocking call's own message (its header packed once: only seq,
        step and batch change per call) and persistent send; an async call's header, which
        each of its channels (pair_async.py) starts from. A call of more than SMALL_BYTES
        (async only) sends its header alone."""
        n = buf.nbytes
        carried = 0 if n > SMALL_BYTES else n                 # the payload's bytes in the message
        head = _HEAD.pack(_AR, 0, 0, buf.size, dtype_code(buf.dtype), _RED[op], -1, _MPI_ALG, int(async_op),
                          0, 0, carried)
        args = {"op": "all_reduce", "bytes": n, "group": self.name, "algorithm": "mpi"}
        if async_op:
            return (n, None, None, None, _UFUNC[op], op == "avg", args, None, [], head)
        sbuf, shead, sview = message(head, buf)
        return (n, sview, self.rbuf[HEAD:HEAD + n].view(buf.dtype).reshape(buf.shape), shead, _UFUNC[op],
                op == "avg", args, [self.recv, self.comm.Send_init(sbuf, self.peer, TAG)], None, head)

    def all_reduce(self, g, buf, op, slot):
        """buf <- buf_r (op) buf_q, checked in the same exchange (module doc). The flight
        recorder's ``enter`` and the exchange are inlined: this is the hot path. The message
        goes out first; the flight record and the byte count are written while it travels
        (the partner's message takes as long to arrive), before anything can block."""
        rec = blocked.ON[0]
        t_in = blocked.enter() if rec else 0.0
        n, sview, rview, shead, ufunc, avg, args, reqs, _, _ = slot
        try:
            ent, seq, t0 = post(self, g, shead, sview, buf, reqs, n)
            wait_all(reqs)
        except BaseException:
            self._requests()                   # the started ones may still be active
            raise
        if shead != self.rhead and g.check:
            self.judge(g, list(shead[:K]), None, lambda: (str(buf.dtype), f"size={buf.size} dtype={buf.dtype} "
                                                           f"op={op} root=-1 algorithm=mpi async_op=False"), self.rbuf)
        ufunc(buf, rview, buf)                 # out=buf, positional (cheaper)
        if avg:
            buf *= 0.5                         # == buf / 2, bit for bit (a power of two)
        if t0:
            trace.record_args("all_reduce", "comm", t0, trace.now(), args)
        ent.state, g._last, _cur[0] = "done", ent, None
        if rec:
            blocked.leave("c", g, t_in, seq)

    def fold(self, count):
        """Hand the calls and bytes counted since the last fold to ``count`` (the group's
        ``_count``: ``ProcessGroup.stats`` folds them in when it is read)."""
        calls, nbytes, self.calls, self.nbytes = self.calls, self.nbytes, 0, 0
        count("all_reduce", nbytes, 0, calls)


def message(head, buf):
    """A message's send buffer [header | payload] (``buf``: the payload's dtype and shape;
    None: the header alone), the packed ``head`` written in; (buffer, its header as int64
    items, the payload's view)."""
    n = 0 if buf is None else buf.nbytes
    sbuf = np.empty(HEAD + n, np.uint8)                        # (HEAD + n,) bytes
    sbuf[:HEAD] = np.frombuffer(head, np.uint8)
    sview = None if buf is None else sbuf[HEAD:].view(buf.dtype).reshape(buf.shape)
    return sbuf, memoryview(sbuf)[:HEAD].cast("q"), sview


def post(pair, g, shead, sview, buf, reqs, n):
    """The next sequence number's message: seq, step and batch into its header ``shead``
    (the rest was packed with its slot), the payload into ``sview`` (None: a header alone),
    sent and its receive posted (``reqs``, persistent); then, while it travels, its
    flight-recorder entry (the one this rank now works on) and its ``n`` bytes counted on
    ``pair``; (entry, seq, trace start)."""
    g._seq += 1
    seq, step = g._seq, _step[0]
    if ON_ENTER:
        for hook in ON_ENTER:
            hook()
    t0 = trace.now() if _trace_on["on"] else 0.0
    if sview is not None:
        sview[...] = buf                       # (cheaper than np.copyto for a small array)
    shead[1], shead[2], shead[9] = seq, step, _batch[0]
    MPI.Prequest.Startall(reqs)
    _cur[0] = ent = Entry((g.name, g.ranks, "all_reduce", seq, step, buf.size, buf.dtype, None, time()))
    ent.state = "started"
    _flight.append(ent)
    pair.calls += 1
    pair.nbytes += n                           # the ring accounting: 2(n-1)/n * S = S at n = 2
    return ent, seq, t0


__all__ = ["PairCheck", "SMALL_BYTES", "FUSED", "message", "post"]
