"""``Work``: the handle an ``async_op=True`` collective returns.

    w = pg.all_reduce(grad, async_op=True)   # communication starts now
    loss = more_compute()                    # ... overlaps with it
    w.wait()                                 # grad now holds the sum

``wait()`` blocks until the operation is done (cooperatively when ranks
outnumber cores), then runs the operation's finishing step (e.g. the division
of ``op="avg"``) and records its trace span from issue to completion.
``is_completed()`` polls without blocking (and also drives MPI's progress).
"""
from pdist import trace


class Work:
    __slots__ = ("_wait", "_test", "_then", "_done", "_span", "_check")

    def __init__(self, wait=None, test=None, then=None, span=None):
        self._wait, self._test, self._then, self._span = wait, test, then, span
        self._check = None      # the deferred argument check of an async collective
        self._done = wait is None

    @classmethod
    def completed(cls):
        """A handle for an operation that already finished (hand-built algorithms
        run eagerly even when ``async_op=True``)."""
        return cls()

    def _verify(self):
        if self._check is not None:
            check, self._check = self._check, None
            check()          # raises CollectiveMismatchError on every rank on a mismatch

    def _finish(self):
        self._verify()
        self._done = True
        if self._then is not None:
            self._then()
        if self._span is not None:
            name, t0, args = self._span
            trace.record(name, "comm", t0, trace.now(), **args)

    def wait(self):
        """Block until done; afterwards the output buffers hold the result."""
        if not self._done:
            self._verify()   # before waiting on data that a mismatch may never deliver
            self._wait()
            self._finish()

    def is_completed(self):
        """True once the operation is done (never blocks)."""
        if not self._done and self._test():
            self._finish()
        return self._done

    def __repr__(self):
        return f"<Work {'done' if self._done else 'pending'}>"
