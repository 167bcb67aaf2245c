"""Exercise 02 (8 points): data parallelism by hand.

Task. Two functions that pdist plugs into its one training loop (a
``DataParallelNaive`` whose gradient sync is yours, over a ``Local`` whose
micro-batch loop is yours), trained against single-process training:

* ``average_gradients(params, group)``: after backward, every ``p.grad`` becomes the
  mean over the ranks.
* ``accumulate_gradients(module, x, y, k)``: forward and backward over k micro-batches
  of this rank's rows; returns this rank's mean loss.

Math (Li et al. 2020, "PyTorch Distributed", sec. 2-3). Rank r's loss is the mean over
its b = B/n rows, L_r = (1/b) sum_{i in r} l_i, so

    (1/n) sum_r dL_r/dw = (1/B) sum_i dl_i/dw = dL/dw,

the single-process gradient: average (op="avg"), don't sum. With k micro-batches of
b/k rows, scale each micro-batch's loss by 1/k before backward, so the accumulated
gradient is again the mean's gradient.

Hints.
* ``group.all_reduce(p.grad, op="avg")`` works in place on a contiguous array.
* A gradient may be None (the parameter was unused: contribute zeros) or not
  C-contiguous (the tied lm_head leaves an F-ordered one): ``xp.ascontiguousarray``.
* ``logits, loss = module(x_part, y_part)``; ``(loss * (1.0 / k)).backward()``;
  ``loss.item()``.

Grade: ``python -m pdist.grade 02`` (3 ranks and a sub-group of 2: n = 1, 2, 3; checks:
every averaged gradient equals one process's gradient of the whole batch, a None and an
F-ordered gradient, equal to single-process training in float64, bytes =
2(n-1)/n*Psi*b per step, accumulation with k = 2: its gradient and its loss).
"""
from pdist.engine.backend import xp  # noqa: F401


def average_gradients(params, group):
    """p.grad <- (1/n) sum_r p.grad_r for every p in params."""
    raise NotImplementedError("exercise: all-reduce (average) every gradient")


def accumulate_gradients(module, x, y, k):
    """k forward/backward passes over equal slices of (x, y); returns the mean loss (float)."""
    raise NotImplementedError("exercise: gradient accumulation over k micro-batches")
