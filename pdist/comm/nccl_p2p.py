"""Point-to-point over NCCL: the user's isend/irecv (batched in NCCL group calls) and the
hand-built algorithms' send/recv/sendrecv, on the group's communication stream.

NCCL has no tags: messages between two ranks match in issue order. A ``Work``'s
``wait()`` makes the compute stream wait for the event recorded after the transfer (the
host does not block; a later device-to-host read waits under the deadline, gpu_sync.py);
``is_completed()`` queries that event.
"""
from contextlib import contextmanager

from pdist.comm.work import Work


def _ptr(a):
    return a.data.ptr


class NCCLPointToPointMixin:
    """isend / irecv / group_p2p of NCCLBackend (needs ``_issue``, ``nc``, ``rank``, ``_self``,
    ``_batch``, ``p2p``, ``_dtype``, ``_nccl``, ``cupy``)."""

    @contextmanager
    def group_p2p(self):
        """Collect the isend/irecv issued inside; post them as one NCCL group call at the end."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
        self._post(batch)

    def _post(self, batch):
        """Post [(kind, buf, peer, tag, holder)]: self-messages as copies (sends first), the
        rest in one group call; every holder gets the event recorded after it."""
        for kind, buf, peer, tag, _ in batch:
            if kind == "send" and peer == self.rank:
                self._self.setdefault(tag, []).append(buf.copy())
        for kind, buf, peer, tag, _ in batch:
            if kind == "recv" and peer == self.rank:
                q = self._self.get(tag)
                if not q:
                    raise RuntimeError(f"NCCL: a receive from this rank itself (tag {tag}) before the "
                                       "matching send: the program must send to itself first")
                buf[...] = q.pop(0)
        wire = [(k, b, p) for k, b, p, _, _ in batch if p != self.rank and b.size]
        nccl, dtype = self._nccl, self._dtype

        def go(s):
            if not wire:
                return
            nccl.groupStart()
            for kind, buf, peer in wire:
                if kind == "send":
                    self.nc.send(_ptr(buf), buf.size, dtype(buf), peer, s)
                else:
                    self.nc.recv(_ptr(buf), buf.size, dtype(buf), peer, s)
            nccl.groupEnd()
        done = self._issue(go)
        for *_, holder in batch:
            holder.append(done)

    def _p2p_work(self, kind, buf, peer, tag):
        holder = []
        if self._batch is not None:
            self._batch.append((kind, buf, peer, tag, holder))
        else:
            self._post([(kind, buf, peer, tag, holder)])
        cupy = self.cupy

        def wait():
            cupy.cuda.get_current_stream().wait_event(holder[0])
        return Work(wait=wait, test=lambda: bool(holder) and holder[0].done, keep=(buf,))

    def isend(self, buf, dst, tag=0):
        self.p2p.wire_bytes += buf.nbytes
        return self._p2p_work("send", buf, dst, tag)

    def irecv(self, buf, src, tag=0):
        return self._p2p_work("recv", buf, src, tag)


class NCCLP2P:
    """send / recv / sendrecv over NCCL (the hand-built algorithms' transport, and the user's
    blocking send/recv: one communicator, so they match isend/irecv in issue order), on the
    group's communication stream, the compute stream ordered after each."""

    def __init__(self, be):
        self.be, self.nc, self.rank, self.size, self.wire_bytes = be, be.nc, be.rank, be.size, 0

    def _do(self, fn):
        self.be.cupy.cuda.get_current_stream().wait_event(self.be._issue(fn))

    def send(self, buf, dst, tag=0):
        self.wire_bytes += buf.nbytes
        if buf.size:
            self._do(lambda s: self.nc.send(_ptr(buf), buf.size, self.be._dtype(buf), dst, s))

    def recv(self, buf, src, tag=0):
        if buf.size:
            self._do(lambda s: self.nc.recv(_ptr(buf), buf.size, self.be._dtype(buf), src, s))

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        self.wire_bytes += sendbuf.nbytes
        dtype = self.be._dtype

        def go(s):
            self.be._nccl.groupStart()                     # both at once: no deadlock in a ring
            if sendbuf.size:
                self.nc.send(_ptr(sendbuf), sendbuf.size, dtype(sendbuf), dst, s)
            if recvbuf.size:
                self.nc.recv(_ptr(recvbuf), recvbuf.size, dtype(recvbuf), src, s)
            self.be._nccl.groupEnd()
        self._do(go)

    def sendrecv_iter(self, sendbuf, dst, recvbuf, src, tag=0):
        """One segment: the GPU already overlaps (kernels queue on the stream)."""
        self.sendrecv(sendbuf, dst, recvbuf, src, tag)
        yield 0, recvbuf.size
