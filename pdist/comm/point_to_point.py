"""Point-to-point calls of ProcessGroup: send, recv, isend, irecv, sendrecv and
batch_isend_irecv, each recorded in the flight recorder, traced and counted
(``stats["send"]``: the bytes sent; ``stats["recv"]``: 0).

NumPy arrays go over the group's user communicator (MPI), CuPy arrays over the
device transport (nccl.py, or MPI with host staging). On a simulated cluster
(topology.py) each message is charged the alpha-beta time of its link.
"""
from contextlib import nullcontext

from pdist.measure import blocked, trace
from pdist.comm import flight_recorder, topology
from pdist.comm.flight_recorder import _cur
from pdist.comm.mpi import contiguous_flat
from pdist.engine.backend import is_device_array


class PointToPoint:
    """Mixed into ProcessGroup: send, recv, isend, irecv, sendrecv, batch_isend_irecv."""

    def _p2p(self, op, buf, peer, nbytes, start):
        flat = contiguous_flat(buf, f"{op} buf")
        if not 0 <= peer < self.size:
            raise ValueError(f"{op}: peer {peer} is not a rank of group '{self.name}' (size {self.size})")
        self._count("send" if op in ("send", "isend") else "recv", nbytes, nbytes)
        ent = flight_recorder.enter(self, op, 0, flat.size, flat.dtype, peer=self.ranks[peer])
        t0 = trace.now()
        rec = blocked.ON[0]                        # host time blocked here (measure/blocked.py)
        t_in = blocked.enter() if rec else 0.0
        work = start(flat)
        if rec:
            blocked.leave("p", self, t_in)
            if work is not None:
                work._wf = ("p", self, None)
        args = {"op": op, "bytes": int(flat.nbytes), "group": self.name, "peer": peer}
        if self._link is not None:                 # a simulated link between the two ranks
            link = topology.link_for([self.ranks[self.rank], self.ranks[peer]])
            if work is None:
                topology.charge(self, op, flat.nbytes, link)
            else:
                since, w = trace.now(), work._wait
                work._wait = lambda: (w(), topology.charge(self, op, flat.nbytes, link, since))
        if work is None:
            trace.record(op, "comm", t0, trace.now(), **args)
            ent.state = "done"
        else:
            work._span, inner = (op, t0, args), work._wait
            work._wait = lambda: (_cur.__setitem__(0, ent), inner())   # waits report this call
        _cur[0] = None
        return work

    def _pt(self, buf):
        if is_device_array(buf):      # the user's send/recv: the communicator of its isend/irecv
            be = self._backend(buf)[0]
            return getattr(be, "user_p2p", be.p2p)
        return self._user

    def send(self, buf, dst, tag=0):
        """Send buf to rank ``dst`` of this group (blocks until buf is reusable)."""
        self._p2p("send", buf, dst, buf.nbytes, lambda f: self._pt(buf).send(f, dst, tag))

    def recv(self, buf, src, tag=0):
        """Receive into buf from rank ``src`` (size and dtype must match the send)."""
        self._p2p("recv", buf, src, 0, lambda f: self._pt(buf).recv(f, src, tag))

    def isend(self, buf, dst, tag=0):
        """Non-blocking send: returns a Work; buf must stay untouched until wait()."""
        return self._p2p("isend", buf, dst, buf.nbytes, lambda f: self._native(buf).isend(f, dst, tag))

    def irecv(self, buf, src, tag=0):
        """Non-blocking receive: returns a Work; buf is valid after wait()."""
        return self._p2p("irecv", buf, src, 0, lambda f: self._native(buf).irecv(f, src, tag))

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        """Send ``sendbuf`` to rank ``dst`` while receiving ``recvbuf`` from rank ``src``;
        returns when both are done. The deadlock-free exchange: the receive is posted
        before either side waits, so a ring (every rank sends right, receives left) never
        deadlocks, where ``send`` then ``recv`` on every rank waits forever once a message
        is too large for MPI to buffer (docs/collectives.md). Counts as a send of
        sendbuf.nbytes (stats["send"]) and a receive."""
        r = self.irecv(recvbuf, src, tag)
        s = self.isend(sendbuf, dst, tag)
        r.wait()
        s.wait()

    def batch_isend_irecv(self, ops):
        """Post ``ops`` = [("send"|"recv", buf, peer, tag)] together; returns their Works
        in order. Over MPI each is an ``isend``/``irecv``. Over NCCL they go out in one
        group call (ncclGroupStart/End), so a send and a receive between two ranks in one
        batch can't deadlock (a lone NCCL send blocks its stream until matched), and a
        message to this rank itself is a local copy."""
        if not ops:
            return []
        native = self._native(ops[0][1])
        with getattr(native, "group_p2p", nullcontext)():
            return [(self.isend if kind == "send" else self.irecv)(buf, peer, tag)
                    for kind, buf, peer, tag in ops]

    def _native(self, buf):
        return self._backend(buf)[0] if is_device_array(buf) else self._user_nb
