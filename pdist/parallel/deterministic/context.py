"""Context parallelism in the deterministic mode (docs/deterministic.md, "Under context parallelism").

Under cp = C (Ulysses) rank (d, c) holds token chunk c, [c T/C, (c+1) T/C), of its dp rows, and
its weight gradients are K-sums over ITS tokens only. So the tree's leaves are (chunk c,
granule j): the gradient's sum over the tokens of chunk c of granule j's rows,

    d_{c,j} = sum_{t in chunk c of granule j} x_t^T dy_t,      dy_t = dL/dy_t (the whole loss's)
    g = 1/(C G) S(0, C G),      leaf index c G + j (chunk-major)

(dy_t is the same on every layout: each token's seed is 1/(g T/C), the mean over its chunk
of a granule, scaled once by 1/(C G) at the root, a power of two, exact). Rank (d, c) then
holds the aligned block of leaves [c G + d G/dp, c G + (d+1) G/dp), a whole subtree at tree
position c dp + d; the dp x cp group orders its ranks d cp + c (pdist/comm/mesh.py), so the
join's recursive doubling runs over the tree positions (``positions``), not the group's ranks.

One process (``Deterministic(G, cp_chunks=C)``, no cp) runs the batched pass over C G stacks,
chunk-major: stack c n + i holds the rows of granule i, tokens of chunk c, (g, T/C), so every
GEMM, row sum and scatter-add has the rank's shape and data. Only attention and the positions
see the whole sequence: ``one_process_chunks`` gives the attention modules a context that puts
the chunks back into their rows, (n g, T, 3C), runs the fused attention over all heads (Ulysses
runs it over n_head / C heads of the same (b, head) slices, the same per-slice GEMMs), and
cuts the output back; and GPT's ``embed`` reads each stack's positions, c T/C + [0, T/C),
summing their gradient per stack over its g rows (the rank's broadcast sum).

Ring attention (plain and zigzag) combines key chunks by an online softmax in the ring's order,
which one process does not reproduce: refused, like tp, pp and Llama's RoPE with cp (not yet).
"""
import contextlib

import numpy as np

from pdist.engine import attention
from pdist.models.plan import PositionShard, plan_of, select


def check_cp(det, cfg, dp, cp, tp=1, pipeline=False, mode=None):
    """What the mode refuses under context parallelism over ``cp`` ranks (``mode``: the
    ``context_parallel`` name), each with its reason; the same on every rank, before any
    collective. Records cp on the policy (the data-parallel wrapper's group spans dp x cp)."""
    C = det.cp_chunks
    if cp == 1:
        if C > 1 and (dp > 1 or tp > 1 or pipeline):
            raise ValueError(f"deterministic mode: cp_chunks = {C} is the one process's view of cp = {C}; "
                             f"a layout with cp = 1 (dp = {dp}, tp = {tp}) needs cp_chunks = 1")
        return
    if C != cp:
        raise ValueError(f"deterministic mode under context parallelism: cp = {cp} cuts every sequence into "
                         f"{cp} token chunks, the tree's leaves; pass deterministic=dict(cp_chunks={cp}) "
                         f"(got cp_chunks = {C}; one process then computes the {cp} chunks' leaves too)")
    if mode not in (None, "ulysses"):
        raise ValueError(f"deterministic mode: context_parallel={mode!r} is refused: ring attention adds the "
                         f"key chunks' partial softmaxes in the ring's order, which one process does not "
                         f"compute; use context_parallel='ulysses' (whole-sequence attention per head)")
    learned = any(isinstance(s, PositionShard) for s in plan_of(cfg).sequence.values())
    why = ("tp > 1" if tp > 1 else "a pipeline" if pipeline else "a mixture of experts"
           if getattr(cfg, "n_expert", 0) else None if learned else "a model without learned positions "
           "(Llama's RoPE per chunk)")
    if why:
        raise ValueError(f"deterministic mode: context parallelism with {why} is not a granule tree yet; use "
                         f"cp = 1 or deterministic=False")
    det.cp_ranks = cp


def positions(det, n):
    """(tree position of each group rank, group rank of each tree position) for a data-parallel
    group of n ranks: identity, or under cp the dp x cp group (rank d cp + c at position c dp + d)."""
    cp = det.cp_ranks
    if cp == 1:
        order = list(range(n))
        return order, order
    dp = n // cp
    pos = [(r % cp) * dp + r // cp for r in range(n)]
    inv = [0] * n
    for r, p in enumerate(pos):
        inv[p] = r
    return pos, inv


def under_context(module):
    """True on a context-parallel rank (its attention modules hold a ContextAttention)."""
    return any(getattr(m, "context", None) is not None for _, m in module.named_modules())


def chunk_rows(a, C):
    """a (n g, T), the rows of n granules of g rows -> (C n g, T/C), chunk-major: rows
    [(c n + i) g, (c n + i + 1) g) are granule i's at chunk c's tokens (stack c n + i)."""
    R, T = a.shape
    if T % C:
        raise ValueError(f"deterministic mode: cp_chunks = {C} needs a sequence length divisible by {C}, got "
                         f"T = {T}")
    return np.ascontiguousarray(a.reshape(R, C, T // C).transpose(1, 0, 2)).reshape(C * R, T // C)


class ChunkAttention:
    """One process's attention over C chunk stacks (module docstring): qkv (C R, T/C, W) ->
    rows (R, T, W), the fused attention over all heads, -> (C R, T/C, n_head hs)."""

    def __init__(self, C):
        self.C = C

    def __call__(self, qkv, n_head, n_kv_head=None):
        C = self.C
        CR, Tc, W = qkv.shape
        R = CR // C
        rows = qkv.reshape(C, R, Tc, W).permute(1, 0, 2, 3).reshape(R, C * Tc, W)        # (R, T, W)
        y = attention.CausalAttention.apply(rows, n_head=n_head, n_kv_head=n_kv_head)  # (R, T, n_head hs)
        return y.reshape(R, C, Tc, y.shape[-1]).permute(1, 0, 2, 3).reshape(CR, Tc, y.shape[-1])


@contextlib.contextmanager
def one_process_chunks(model, C, stacks):
    """For the batched pass over ``stacks`` = C n chunk stacks: the attention modules get a
    ``ChunkAttention``, GPT's ``embed`` the stacks' positions (module docstring)."""
    if not hasattr(model, "transformer") or not hasattr(model.transformer, "wpe"):
        raise ValueError(f"deterministic mode: cp_chunks > 1 covers GPT-2 (learned positions) so far, not "
                         f"{type(model).__name__}; use cp_chunks = 1")
    mods = [m for pattern in plan_of(model).heads for _, m in select(pattern, list(model.named_modules()))]
    tr = model.transformer

    def embed(idx):
        idx = model.tokens(idx)
        R, Tc = idx.shape
        n = stacks // C
        pos = np.repeat(np.arange(C)[:, None] * Tc + np.arange(Tc), n, axis=0)            # (S, T/C)
        tok = tr.wte(idx)                                                               # (S g, T/C, E)
        pe = tr.wpe(pos)                                                                # (S, T/C, E)
        E, g = tok.shape[-1], R // stacks
        x = tok.reshape(stacks, g, Tc, E) + pe.reshape(stacks, 1, Tc, E)                # per stack, as a rank
        return model.drop(x.reshape(R, Tc, E))

    for m in mods:
        m.context = ChunkAttention(C)
    model.embed = embed
    try:
        yield
    finally:
        del model.embed
        for m in mods:
            m.context = None


__all__ = ["check_cp", "positions", "under_context", "chunk_rows", "ChunkAttention", "one_process_chunks"]
