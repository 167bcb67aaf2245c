"""Exercise 06 (9 points): Megatron's ColumnParallelLinear and RowParallelLinear.

Task. Write Megatron's two conjugate regions as autograd Functions, and the forward of
the two layers with them. The grader builds pdist's ``ColumnParallelLinear`` (weight
A_i: (in, out/t), bias a_i) and ``RowParallelLinear`` (weight B_i: (in/t, out), bias b
replicated) with your forwards and runs a TP MLP, Y = GeLU(X A + a) B + b, against the
single-process MLP: output, dX and every weight gradient.

Math (Shoeybi et al. 2019, sec. 3). Split A by columns and B by rows:
GeLU(X A) B = sum_i GeLU(X A_i) B_i, so rank i computes its term with no communication
in between. Two regions close the block:

    f (CopyToTP):      forward identity;   backward all-reduce (dX = sum_i dX_i)
    g (ReduceFromTP):  forward all-reduce; backward identity

Column: Y_i = f(X) A_i + a_i. Row: Y = g(X_i B_i) + b (the bias once, after the sum).
One all-reduce in forward, one in backward, of B*T*C values each.

Hints.
* A Function: ``forward(self, x, group)`` gets arrays and returns an array (keep what
  backward needs on ``self``); ``backward(self, g)`` returns the gradient of x (the
  group needs none). Use it as ``CopyToTP.apply(x, group)``.
* Copy before reducing in place (``xp.array(g, copy=True, order="C")``): a gradient
  array can be shared by two branches of the graph.
* ``from pdist import functional as F``; ``F.linear(x, weight, bias=None)`` is x W + b.
  The layer has ``layer.weight``, ``layer.bias``, ``layer.group``.

Grade: ``python -m pdist.grade 06`` (4 ranks and sub-groups, so t = 1, 2, 3, 4; f and g
alone: identity and sum, never changing the arrays they are given; the TP MLP's output
and every gradient; one all-reduce forward, one backward).
"""
from pdist.engine.autograd import Function
from pdist.engine.backend import xp  # noqa: F401


class CopyToTP(Function):
    """f: forward identity, backward all-reduce."""

    def forward(self, x, group):
        raise NotImplementedError("exercise: f's forward")

    def backward(self, g):
        raise NotImplementedError("exercise: f's backward")


class ReduceFromTP(Function):
    """g: forward all-reduce, backward identity."""

    def forward(self, x, group):
        raise NotImplementedError("exercise: g's forward")

    def backward(self, g):
        raise NotImplementedError("exercise: g's backward")


def column_parallel_forward(layer, x):
    """Y_i = f(X) A_i + a_i (the output stays split: (..., out/t))."""
    raise NotImplementedError("exercise: ColumnParallelLinear.forward")


def row_parallel_forward(layer, x):
    """Y = g(X_i B_i) + b; x is this rank's (..., in/t) slice."""
    raise NotImplementedError("exercise: RowParallelLinear.forward")
