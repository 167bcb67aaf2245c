"""Which tokens each cp rank holds, and the causal work that gives it: contiguous or zigzag chunks.

Under causal attention query i sees keys j <= i. Ring attention (ring_attention.py) meets
every (query chunk, key chunk) pair once: a pair whose keys all come after its queries is
skipped, the diagonal pair is masked, every other pair is full (``block_pairs``). So the
work of a rank depends on which chunks it holds (``segments``):

    contiguous   cp chunks of T/cp; rank r holds chunk r and computes r + 1 chunk pairs (its
                 diagonal one masked): the last rank works cp times as much as the first
    zigzag       2 cp chunks of T/2cp (Megatron's and Llama 3's head-tail split); rank r holds
                 chunks r and 2 cp - 1 - r and computes (r + 1) + (2 cp - r) = 2 cp + 1 pairs
                 of them, the same on every rank

``attention_work`` counts the score elements each rank computes under either layout (ring
attention counts its own in ``ring_attention.work``, so a run measures it). Ulysses takes
contiguous chunks: its all-to-all joins the ranks' tokens in rank order. The positions of a
rank's tokens are global: ``ContextParallel.local_batch`` cuts the batch at ``positions``,
and the position embeddings and RoPE read them.
"""
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def segments(T, cp, rank, layout="contiguous"):
    """[(start, stop)] of the global positions rank ``rank`` of ``cp`` holds, in order."""
    if layout not in LAYOUTS:
        raise ValueError(f"context parallel layout must be one of {LAYOUTS}, got {layout!r}")
    n = cp if layout == "contiguous" else 2 * cp
    if T % n:
        raise ValueError(f"context parallelism ({layout}, cp = {cp}) needs a sequence length divisible by "
                         f"{n}, got T = {T}; choose T a multiple of {n}")
    c = T // n
    chunks = [rank] if layout == "contiguous" else [rank, 2 * cp - 1 - rank]
    return [(i * c, (i + 1) * c) for i in chunks]


def positions(T, cp, rank, layout="contiguous"):
    """The global positions of rank ``rank``'s tokens, (T/cp,) int64."""
    return np.concatenate([np.arange(a, b) for a, b in segments(T, cp, rank, layout)])


def block_pairs(qsegs, ksegs):
    """[(q local slice, k local slice, diagonal)] of the (query chunk, key chunk) pairs that
    see any key: keys all after the queries are skipped, the same chunk is masked."""
    out, qo = [], 0
    for qa, qb in qsegs:
        ko = 0
        for ka, kb in ksegs:
            if ka < qb and (ka, kb) != (qa, qb) and not kb <= qa:
                raise ValueError(f"ring attention: key chunk {(ka, kb)} overlaps query chunk {(qa, qb)}")
            if ka < qb:
                out.append((slice(qo, qo + qb - qa), slice(ko, ko + kb - ka), (ka, kb) == (qa, qb)))
            ko += kb - ka
        qo += qb - qa
    return out


def attention_work(T, cp, layout="contiguous"):
    """Score elements (query, key pairs) each rank computes: [per rank]. Attention FLOPs of a
    rank are 4 B n_head hs times this (Q K^T and P V, forward). Ring attention counts what it
    does in ``ring_attention.work["scores"]`` (per sequence and head), so a run measures it."""
    work = []
    for r in range(cp):
        q = segments(T, cp, r, layout)
        pairs = [p for s in range(cp) for p in block_pairs(q, segments(T, cp, (r - s) % cp, layout))]
        work.append(sum((a.stop - a.start) * (b.stop - b.start) for a, b, _ in pairs))
    return work


__all__ = ["segments", "positions", "block_pairs", "attention_work", "LAYOUTS"]
