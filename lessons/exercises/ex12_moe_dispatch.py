"""Exercise 12 (6 points): mixture-of-experts dispatch and combine over all-to-all.

Task. Under expert parallelism the E experts of an MoE layer are split over the ep ranks
of a group: rank q holds experts [q E/ep, (q+1) E/ep) (``layer.experts``, E/ep modules;
``layer.n_expert`` is still E). Each rank routes its own N tokens, sends every kept row to
the rank that holds its expert, runs its experts on the rows it receives from every rank,
and sends the results back, where they are weighted by the gate and summed per token.
Write the five pieces:

* ``sort_by_expert(top, n_expert)``: the assignments grouped by expert;
* ``AllToAllV``: an autograd Function around ``group.all_to_all_v`` (forward and backward);
* ``dispatch(xs, counts, group)`` and ``combine(ye, plan, group)``: rows to their experts'
  ranks and back, in the source's order;
* ``moe_forward(layer, x, group)``: the whole layer (dropless);
* ``reduce_gradients(dense, experts, dp_group, edp_group)``: the gradient sync after backward.

Math (GShard, Lepikhin et al. 2020, sec. 2-3; Switch Transformer, Fedus et al. 2021, sec. 2;
docs/experts.md). For the N tokens x_n (rows of x, (N, C)) of this rank:

    p_n  = softmax(x_n W_gate)                  (N, E) ``layer.gate(x)``, then softmax
    S_n  = the k = ``layer.top_k`` largest p_ne (column j of ``top``: the j-th choice)
    w_nj = p_{n, S_nj} / sum_j' p_{n, S_nj'}     (N, k) gate weights, renormalised
    y_n  = sum_j w_nj expert_{S_nj}(x_n)

Number the N k assignments a = j N + n (first choices first). Sorted by expert (stable),
the rows x_{a mod N} form blocks of counts[e] rows for e = 0..E-1. Rank r sends block e to
the rank holding e; it must also know how many rows every other rank sends it: exchange
the counts first (``group.all_to_all`` of an (ep * E/ep,) int64 array). After
all_to_all_v the received rows are grouped by source rank, then by expert; each local
expert needs its own rows together. combine undoes all of it, so row i of its result is
expert(xs_i). all_to_all_v is linear: its backward is all_to_all_v of the gradient with the
counts reversed (the rows go back where they came from).

Gradients. The loss is L = (1/dp) sum_s L_s over the dp shards s. A dense parameter's
gradient on rank s is dL_s: average over dp_group. Expert e's holder receives, through
combine's backward, the gradients of every shard of its ep group: sum them over
edp_group (the ranks holding the same experts), and divide by dp.

Hints.
* ``from pdist.models.moe import Gather, IndexAdd``: ``Gather.apply(x, idx)`` is x[idx]
  (rows, idx may repeat) and ``IndexAdd.apply(y, idx, n=N)`` adds row m of y into row
  idx[m] of N zero rows; both carry gradients. Index with ``xp.asarray(numpy ints)``.
* The routing is on the host: ``to_numpy(probs.data)``; ``np.argsort(..., kind="stable")``.
  ``np.bincount`` needs ``minlength``. A tensor's ``probs[rows, cols]`` (index arrays) keeps
  the gradient; so do ``mul``, ``tsum``, ``reshape``, ``transpose`` and ``/``.
* ``group.all_to_all_v(out, inp, send_counts, recv_counts)``: send_counts[q] rows of inp go
  to rank q (in rank order); out gets recv_counts[q] rows from rank q.
* A local expert e runs once on its rows: ``layer.experts[e](rows)``; ``concat`` the
  outputs (skip an expert with no rows; when none has any, ``xe * 0.0`` is the empty
  output, and the all-to-alls still run: every rank of the group takes part in each).
* Every gradient is an array when ``reduce_gradients`` runs; ``group.all_reduce(a,
  op="sum"|"avg")`` works in place on a flat contiguous array.

Grade: ``python -m pdist.grade 12`` (4 ranks; ep 2 and ep 4: each piece against pdist's
own, then 3 AdamW steps of a small MoE GPT equal one process, float64, rtol 1e-9: the
loss, every dense parameter, the router and every expert).
"""
import numpy as np  # noqa: F401

from pdist.engine import functional as F  # noqa: F401
from pdist.engine.autograd import Function
from pdist.engine.backend import to_numpy, xp  # noqa: F401
from pdist.engine.ops import mul, sum as tsum  # noqa: F401
from pdist.engine.shape_ops import concat, reshape, transpose  # noqa: F401
from pdist.models.moe import Gather, IndexAdd  # noqa: F401


def sort_by_expert(top, n_expert):
    """top (N, k) expert ids (numpy ints). Returns (order, counts): ``order`` (N k,) the
    assignment ids a = j N + n sorted by expert (stable: within an expert, a ascending),
    ``counts`` (n_expert,) the assignments of each expert (0 for an expert nobody chose)."""
    raise NotImplementedError("exercise: sort the assignments by expert")


class AllToAllV(Function):
    """y = x's rows exchanged over ``group``: ``send[q]`` rows to rank q, ``recv[q]`` rows
    from rank q (y has sum(recv) rows); dx: the rows of dy sent back where they came from."""

    def forward(self, x, group=None, send=(), recv=()):
        raise NotImplementedError("exercise: all_to_all_v forward")

    def backward(self, g):
        """Returns (dx, None, None, None)."""
        raise NotImplementedError("exercise: all_to_all_v backward")


def dispatch(xs, counts, group):
    """xs (M, C) Tensor: this rank's rows grouped by global expert, ``counts`` (E,) rows per
    expert. Returns (xe, per_expert, plan): xe (R, C) the rows for this rank's E/ep experts
    from every rank of ``group``, grouped by local expert, then by source rank;
    per_expert: each local expert's row count (a list of E/ep ints); plan: whatever
    ``combine`` needs."""
    raise NotImplementedError("exercise: dispatch rows to their experts' ranks")


def combine(ye, plan, group):
    """ye (R, C) Tensor: the local experts' outputs, in xe's order. Returns (M, C): row i is
    the output for xs's row i (the inverse of dispatch)."""
    raise NotImplementedError("exercise: combine the experts' outputs back")


def moe_forward(layer, x, group):
    """x (N, C) Tensor -> (N, C) Tensor: the MoE layer (``layer.gate``, ``layer.experts``:
    this rank's E/ep experts, ``layer.top_k``, ``layer.n_expert``), dropless, over ``group``."""
    raise NotImplementedError("exercise: the MoE layer under expert parallelism")


def reduce_gradients(dense, experts, dp_group, edp_group):
    """After backward: each dense parameter's ``.grad`` averaged over dp_group; each expert
    parameter's summed over edp_group and divided by dp_group.size. In place."""
    raise NotImplementedError("exercise: the gradient sync of expert parallelism")
