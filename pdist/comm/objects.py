"""Collectives of small Python objects (pickled), for ProcessGroup.

Pickled MPI collectives block inside MPI, with no deadline. So each one first
meets the other ranks in its fingerprint exchange (check.py), which polls with
the watchdog's deadline, or, with the check off, in a polled barrier. Every
member is then known to be present, and the pickled call that follows cannot
wait for a missing rank. Not for hot paths.
"""
from pdist.comm import flight_recorder
from pdist.measure import blocked
from pdist.comm.check import CollectiveMismatchError, agree, fingerprint
from pdist.comm.flight_recorder import _cur, _step
from pdist.comm.mpi import wait_all


class ObjectCollectives:
    """Mixed into ProcessGroup: gather_object, all_gather_object, broadcast_object."""

    def _object_op(self, op, root, run):
        rec = blocked.ON[0]                       # host time blocked here (measure/blocked.py)
        t_in = blocked.enter() if rec else 0.0
        error = self._settle(None) if self._pending else None
        if not 0 <= root < self.size:
            error = error or f"root={root} is not a rank of a group of {self.size}"
        self._seq += 1
        ent = flight_recorder.enter(self, op, self._seq)
        if self.check:
            fp = fingerprint(op, self._seq, _step[0], root=root, error=error)
            agree(self, fp, error, ("-", f"root={root}"), self._fpbuf)
        elif error:
            raise CollectiveMismatchError(f"{op} on group '{self.name}': {error}")
        elif self.size > 1:
            wait_all([self.comm.Ibarrier()])
        out = run()
        ent.state, self._last, _cur[0] = "done", ent, None
        if rec:
            blocked.leave("c", self, t_in, ent.seq)
        return out

    def gather_object(self, obj, dst=0):
        """[obj_0, ..., obj_{n-1}] at dst (None elsewhere)."""
        return self._object_op("gather_object", dst, lambda: self.comm.gather(obj, root=dst))

    def all_gather_object(self, obj):
        """[obj_0, ..., obj_{n-1}] on every rank."""
        return self._object_op("all_gather_object", 0, lambda: self.comm.allgather(obj))

    def broadcast_object(self, obj, src=0):
        """obj of rank src, on every rank."""
        return self._object_op("broadcast_object", src, lambda: self.comm.bcast(obj, root=src))
