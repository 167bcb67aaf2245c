"""Exercise 07 (9 points): vocab-parallel cross-entropy.

Task. The logits (N, V) are split by vocabulary: this rank holds columns
[vocab_start, vocab_start + V/t). Compute each row's cross-entropy without any rank
ever holding a full row of logits, and its gradient.

Math (Shoeybi et al. 2019, sec. 3, "the output embedding"). For row n with target y_n,

    loss_n = log sum_v exp(z_nv - m_n) - (z_{n,y_n} - m_n),   m_n = max_v z_nv

and every term is a sum or max over the vocabulary, so each splits over the ranks:
m = all-reduce(max) of the local maxima; sum of exp = all-reduce(sum) of local sums;
the target's shifted logit = all-reduce(sum) of a vector that is non-zero only on the
rank owning y_n. Only O(N) numbers travel, never the O(N V) logits. The gradient is
local: dloss_n/dz_nv = softmax(z_n)_v - [v == y_n].

Hints.
* ``group.all_reduce(a, op="max")`` / ``op="sum"``, in place on float arrays.
* Subtract the *global* max before ``exp`` (the grader feeds logits near 1000).
* ``local = targets - vocab_start``; the rank owns y_n when 0 <= local < V/t.

Grade: ``python -m pdist.grade 07`` (3 ranks and a sub-group of 2: t = 1, 2, 3; compared
with the full softmax cross-entropy and with pdist's ``vocab_parallel_cross_entropy``;
targets on the first and last id of every rank's slice; grad_rows not all equal).
"""
from pdist.engine.backend import xp  # noqa: F401


def vocab_parallel_ce_forward(logits, targets, vocab_start, group):
    """logits (N, V/t) this rank's columns, targets (N,) ids in [0, V).
    Returns (loss per row (N,), softmax on this rank's columns (N, V/t))."""
    raise NotImplementedError("exercise: vocab-parallel cross-entropy forward")


def vocab_parallel_ce_backward(probs, targets, vocab_start, grad_rows):
    """dL/dlogits on this rank's columns (N, V/t), given dL/dloss_n = grad_rows (N,)."""
    raise NotImplementedError("exercise: vocab-parallel cross-entropy backward")
