"""Exercise 11 (4 points): the online-softmax merge of ring attention's forward.

Task. Write ``merge_block(m, l, o, s, v, diagonal)`` and ``finish(m, l, o)``. Ring attention
(pdist/parallel/context/ring_attention.py, lesson 09) computes a rank's causal attention one
block of keys at a time, as the K/V chunks arrive round the ring, and never holds a whole row
of scores. Your two functions are that merge: the grader plugs them into pdist's ring attention
(the forward yours, the backward pdist's, which reads your log-sum-exp) and compares it with
attention over the whole sequence, then trains a GPT-2 with it under context parallelism.

Math (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; FlashAttention,
Dao et al. 2022). A query row with scores s_j and values v_j over all its keys attends
y = sum_j e^(s_j) v_j / sum_j e^(s_j). Keep, per row, the running max m, the sum
l = sum_j e^(s_j - m) and the output o = sum_j e^(s_j - m) v_j of the blocks seen so far
(before the first block: m = -inf, l = 0, o = 0). A new block, its scores S_b and values V_b:

    m' = max(m, rowmax S_b)
    l' = e^(m - m') l + rowsum e^(S_b - m')
    o' = e^(m - m') o + e^(S_b - m') V_b

and after the last block y = o / l and lse = m + log l, the log-sum-exp log sum_j e^(s_j),
from which backward recomputes P = e^(S - lse). The result is the same whatever the order of
the blocks. Causal attention: on the diagonal block (keys at the queries' own positions) key j
is hidden from query i when j > i (its score is -inf); every other block you are given is
wholly visible (blocks of later keys are skipped before they reach you).

Hints.
* Shapes: m and l (..., tq, 1), o (..., tq, hs), s (..., tq, tk), v (..., tk, hs); the leading
  dimensions are the batch and the heads (any number of them): ``axis=-1, keepdims=True``.
* The diagonal block is square (tq = tk); ``pdist.engine.functional.causal_mask(t, t, dtype)``
  is its additive mask (0, and -inf above the diagonal). Do not change the arrays you are
  given: return new ones.
* Never exponentiate a score as it is: the grader feeds scores near 1000 (e^1000 overflows),
  the large block first and last.
* Try it by hand: two blocks of random scores, merged in both orders, against
  ``softmax`` over the two side by side.

Grade: ``python -m pdist.grade 11`` (3 ranks and a sub-group of 2: the merge alone, blocks in
every order; then inside ring attention at cp = 1, 2, 3, contiguous and zigzag chunks, fused
and grouped-query heads: y, dQ, dK, dV against whole-sequence attention; then GPT-2 trained
under ``context_parallel="ring-zigzag"`` against one process, float64, rtol 1e-9).
"""
from pdist.engine.backend import xp  # noqa: F401
from pdist.engine.functional import causal_mask  # noqa: F401


def merge_block(m, l, o, s, v, diagonal):
    """Fold one block into the running state: returns (m', l', o'), shaped as m, l, o.
    ``diagonal``: True when the block's keys are the queries' own positions (mask it)."""
    raise NotImplementedError("exercise: the online-softmax merge of one block")


def finish(m, l, o):
    """After the last block: (y (..., tq, hs), lse (..., tq, 1))."""
    raise NotImplementedError("exercise: the output and log-sum-exp")
