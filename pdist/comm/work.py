"""``Work``: the handle an ``async_op=True`` collective returns.

    w = pg.all_reduce(grad, async_op=True)   # communication starts now
    loss = more_compute()                    # ... overlaps with it
    w.wait()                                 # grad now holds the sum

``wait()`` first checks that every rank issued the same collective (the
fingerprint exchange posted at issue, check.py), then waits for the data (with
the watchdog's deadline, watchdog.py), runs the transport's finishing step
(``finish``: host staging's copy back to the device), then the operation's
(``then``: e.g. the division of ``op="avg"``), and records its trace span from
issue to completion. ``is_completed()`` polls without blocking; when it finds the
data arrived it runs the same steps, once, so a polled handle's buffers hold the
result as a waited one's do.

Buffers. MPI reads and writes the arrays until the operation completes, so
the handle, and the group's record of it (``Pending``), hold references to
them until ``wait()``: an async op on a temporary array stays safe, and even a
dropped handle cannot free memory MPI still writes to. A dropped handle is
reported at the group's next collective (every rank raises), and a handle
never waited on at exit fails the job.
"""
from pdist.measure import blocked, trace
from pdist.comm import flight_recorder


class Pending:
    """The group's record of one async op until it is waited on."""
    __slots__ = ("check", "wait", "keep", "entry", "group", "waited", "dropped", "error")

    def __init__(self, check, wait, keep, entry, group):
        self.check, self.wait, self.keep, self.entry, self.group = check, wait, keep, entry, group
        self.waited = self.dropped = False
        self.error = None

    def ready(self):
        """True when the fingerprint check can finish without waiting (or is done)."""
        return self.error is not None or self.check is None or getattr(self.check, "ready", lambda: True)()

    def verify(self):
        """Run the deferred fingerprint check once (raises on a mismatch, every rank)."""
        if self.error is not None:
            raise self.error
        if self.check is not None:
            check, self.check = self.check, None
            flight_recorder._cur[0] = self.entry   # a wait here reports this op (and sees a peer's exit)
            try:
                check()
            except Exception as e:
                # a mismatch: this op and every later async op of the group were issued on
                # misaligned collectives; they raise the same error if waited on, and keep
                # their buffers (MPI may still touch them) without failing the exit
                g = self.group
                later = [q for q in g._pending if not q.waited and q.entry.seq > self.entry.seq]
                for q in [self] + later:
                    q.error, q.waited, q.check = e, True, None
                g._orphans.extend([self] + later)
                g._pending = [q for q in g._pending if not q.waited]
                raise


class Work:
    __slots__ = ("_wait", "_test", "_then", "_fin", "_done", "_span", "_keep", "_pending", "_wf", "__weakref__")

    def __init__(self, wait=None, test=None, then=None, span=None, keep=(), finish=None):
        self._wait, self._test, self._then, self._span = wait, test, then, span
        self._fin = finish           # the transport's finishing step, after the data arrived
        self._keep = keep            # buffers MPI may still touch
        self._pending = None         # the group's record (async collectives)
        self._wf = None              # (kind, group, seq): record the wait's blocked time (measure/blocked.py)
        self._done = wait is None

    @classmethod
    def completed(cls):
        """A handle for an operation that already finished (hand-built algorithms
        run eagerly even when ``async_op=True``)."""
        return cls()

    def _finish(self):
        p = self._pending
        if p is not None:
            p.verify()
            p.waited, p.keep, p.entry.state = True, None, "done"
            g = p.group
            last = g._last                        # what an exit announces: "exited after #k"
            if last is None or last.seq < p.entry.seq:
                g._last = p.entry
            if g._pending and g._pending[-1] is p:
                g._pending.pop()                  # (settle would drop it: it is waited)
        self._done, self._keep = True, None
        if self._fin is not None:
            self._fin()
        if self._then is not None:
            self._then()
        if self._span is not None:
            name, t0, args = self._span
            trace.record_args(name, "comm", t0, trace.now(), args)   # (events() copies args)

    def wait(self):
        """Block until done; afterwards the output buffers hold the result."""
        if not self._done:
            wf = self._wf
            t = blocked.enter() if wf is not None else 0.0
            p = self._pending
            if p is not None:
                p.verify()   # before waiting on data that a mismatch may never deliver
                flight_recorder._cur[0] = p.entry
            self._wait()
            self._finish()
            if wf is not None:
                blocked.leave(*wf[:2], t, wf[2])

    def is_completed(self):
        """True once the operation is done (never blocks)."""
        if not self._done and self._test():
            self._finish()
        return self._done

    def __del__(self):
        p = self._pending
        if p is not None and not p.waited:
            p.dropped = True          # the group reports it at its next collective

    def __repr__(self):
        return f"<Work {'done' if self._done else 'pending'}>"


def complete_fn(work):
    """``work``'s wait and finishing step as one function that holds no reference to the
    Work (the group's Pending keeps it: a dropped handle must still be collectable)."""
    wait, fin = work._wait, work._fin
    if fin is None:
        return wait

    def complete():
        wait()
        fin()
    return complete


def settle(group, error, block=True):
    """Before a new collective on ``group``: finish earlier async ops' fingerprint
    checks, in issue order (a mismatch raises on every rank, as the other ranks
    meet the same check at the same place); complete any op whose handle was
    dropped without ``wait()`` and return that as the new call's local error
    (so every rank raises); keep the rest for their ``wait()``. Before another
    async op (``block=False``: DDP issuing its buckets during backward) it only
    finishes the checks that are already complete, in order, and never waits for
    a slower rank: a mismatch then shows at a ``wait()`` or the next blocking call."""
    keep = []
    for i, p in enumerate(group._pending):
        if p.waited:
            continue
        if not block and not p.ready():
            keep += [q for q in group._pending[i:] if not q.waited]
            break
        try:
            p.verify()
        except Exception:                     # a mismatch (or a timeout) on every rank
            group._orphans.append(p)          # its data may never complete: keep the buffers
            group._pending = [q for q in group._pending if q is not p and not q.waited]
            raise
        if p.dropped:
            p.wait()                          # every rank issued it: it completes
            p.waited, p.entry.state = True, "dropped"
            if group._last is None or group._last.seq < p.entry.seq:
                group._last = p.entry
            error = error or (f"async {flight_recorder.describe(p.entry.as_dict())} was never waited "
                              f"on (its Work was dropped); call .wait() on every Work")
            continue
        keep.append(p)
    group._pending = keep
    return error
