"""Bounds checks of token ids (embedding rows, loss targets), one host read per step on a device.

An out-of-range id must raise, never read a wrong row: CuPy wraps it around silently. On the
host the check is immediate. On a device, reading the ids' bounds waits for the GPU, so inside
``deferred_index_checks()`` (every training step: ``Strategy.forward_backward``) the bounds stay
on the device and are read together, in one copy, when the block ends.
"""
import contextlib

from pdist.engine.backend import array_module, is_device_array, to_numpy


_deferred = []    # None, or the open deferred_index_checks() scope's list of (bounds, n, what)


def check_indices(idx, n, what="index"):
    """Raise a clear error unless idx is an integer array with values in [0, n).

    Reading a device array's bounds is a device -> host copy that waits for the GPU. Inside
    ``deferred_index_checks()`` (every training step: ``Strategy.forward_backward``) the bounds
    of device arrays are kept on the device and checked together when the block ends: one
    copy per step for all the embeddings and losses of all micro-batches. Host arrays are
    checked at once (no copy to wait for)."""
    if not hasattr(idx, "dtype") or idx.dtype.kind not in "iu":
        raise TypeError(f"{what} must be an integer array, got "
                        f"{getattr(idx, 'dtype', type(idx).__name__)}")
    if idx.size:
        if is_device_array(idx):
            bounds = array_module(idx).stack([idx.min(), idx.max()])  # (2,), stays on the device
            if _deferred:
                _deferred[-1].append((bounds, n, what))
                return
            _raise_out_of_range([(to_numpy(bounds), n, what)])
        else:
            _raise_out_of_range([((idx.min(), idx.max()), n, what)])


def _raise_out_of_range(checks):
    for (lo, hi), n, what in checks:
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= n:
            raise IndexError(f"{what} out of range: values span [{lo}, {hi}] but must lie in [0, {n})")


@contextlib.contextmanager
def deferred_index_checks():
    """Collect the device index checks of the block and run them all at its end with one
    device -> host copy (see ``check_indices``). Raises the first violation's IndexError
    then; nothing is checked if the block raised. Nests (an inner scope checks at its end)."""
    _deferred.append([])
    try:
        yield
    finally:
        checks = _deferred.pop()
    if checks:
        xpm = array_module(checks[0][0])
        both = to_numpy(xpm.stack([b for b, _, _ in checks]))  # (n_checks, 2): the one copy
        _raise_out_of_range([(b, n, what) for b, (_, n, what) in zip(both, checks)])
