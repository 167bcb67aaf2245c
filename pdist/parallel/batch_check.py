"""The ranks that must train on one global batch are handed the same one (``check_batch``).

pdist's one loop hands every rank the global batch of the step, ``local_batch(*get_batch(step))``,
and the strategies cut it (DP/ZeRO: rows; TP and PP: every rank of the group keeps it all). A
loader that differs per rank (seeded by the rank, as PyTorch DDP code often is; a corpus that
depends on what the process imported) trains a silently wrong model. So the outermost
``local_batch`` hashes (x, y), ``forward_backward`` stamps the hash on the step, and the
collective check (pdist/comm/check.py) compares it at every collective of the step: a
difference raises ``BatchMismatchError`` on every rank of the group, naming the ranks and what
``get_batch`` must return. Cost: one blake2b pass over the batch's bytes per step (14 us for
a lesson's 16 x 32 int64 tokens; docs/failures.md), on the host (a device array is folded on the device and
only its 32-byte sums are copied: flight_recorder.batch_hash).
``PDIST_CHECK_BATCH=0`` or ``model.check_batch = False`` turns it off.
"""
import functools

from pdist.comm.flight_recorder import batch_hash
from pdist.engine.env import env_flag


def batch_default():
    """``check_batch``'s default: on, unless ``PDIST_CHECK_BATCH=0`` (read when a ``Local`` is
    built). The outermost ``local_batch(x, y)`` hashes the global batch it is handed (blake2b,
    14 us for a lesson's 16 x 32 tokens) and ``forward_backward`` stamps the hash on the
    step (``comm.set_step(k, batch=h)``): every collective of the step compares it, so ranks
    handed different global batches (a loader seeded by rank) raise BatchMismatchError at the
    step's first collective, on every rank of the group."""
    return env_flag("PDIST_CHECK_BATCH", True)


_depth = [0]              # local_batch calls in progress (only the outermost hashes)
_pending = [0]            # the hash of the global batch the last outermost local_batch was handed


def take_pending():
    """The hash the outermost ``local_batch`` computed since the last call (0: none), once."""
    h, _pending[0] = _pending[0], 0
    return h


def _hashing(fn):
    """``local_batch`` that hashes the global batch when it is the outermost call."""
    @functools.wraps(fn)
    def local_batch(self, x, y):
        if _depth[0] == 0:
            _pending[0] = batch_hash(x, y) if self.check_batch and self.stamps_step else 0
        _depth[0] += 1
        try:
            return fn(self, x, y)
        finally:
            _depth[0] -= 1
    local_batch.hashes_batch = True
    return local_batch


class BatchCheck:
    """Mixed into ``Strategy``: every subclass's own ``local_batch`` is wrapped by ``_hashing``."""

    def __init_subclass__(cls, **kw):
        """Every strategy's own ``local_batch`` hashes the global batch when called outermost."""
        super().__init_subclass__(**kw)
        fn = cls.__dict__.get("local_batch")
        if fn is not None and not getattr(fn, "hashes_batch", False):
            cls.local_batch = _hashing(fn)


__all__ = ["BatchCheck", "batch_default", "take_pending"]
