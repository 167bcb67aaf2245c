"""The errors pdist raises on every rank when a run cannot go on correctly.

Each one ends the job with a message that names the rank(s) and the place:
``CollectiveMismatchError`` and ``CollectiveTimeoutError`` live in
``pdist.comm`` (they are about collectives); this module holds the ones about
the numbers being trained.
"""


class NonFiniteError(FloatingPointError):
    """A loss or gradient is NaN or infinite (``check_finite=True`` on a strategy,
    ``clip_grad_norm_(..., error_if_nonfinite=True)``). The message names the
    rank, the parameter and the training step."""


__all__ = ["NonFiniteError"]
