"""Checks of exercise 11 (the online-softmax merge of ring attention's forward), run through
pdist/course/checks.py.

The student's ``merge_block(m, l, o, s, v, diagonal)`` and ``finish(m, l, o)`` are checked on
their own (blocks of scores in every order, against the softmax over all the keys at once;
scores near 1000, in both orders), then plugged into pdist's ring attention: ``_StudentRing``
is ``RingAttention`` with the student's merge in its forward and pdist's backward, which reads
the student's log-sum-exp (so a wrong lse shows in dQ, dK, dV). Last, GPT-2 trains under
``context_parallel="ring-zigzag"`` with it, against one process (float64, rtol 1e-9)."""
import itertools
import math

import numpy as np

from pdist.course.common import CheckFailed, SEED, close, need, sub_groups


def _finite_close(got, want, what):
    got = np.asarray(got, dtype=np.float64)
    need(got.shape == np.shape(want), f"{what}: shape {got.shape}, expected {np.shape(want)}")
    need(bool(np.all(np.isfinite(got))), f"{what} is not finite ({int(np.sum(~np.isfinite(got)))} of {got.size} "
                                         f"values inf or nan)")
    close(got, want, what)


def _merged(S, blocks, hs):
    """(y, lse) of the student's merge over ``blocks`` [(s, v, diagonal)] in that order."""
    lead, tq = blocks[0][0].shape[:-2], blocks[0][0].shape[-2]
    m, l, o = np.full(lead + (tq, 1), -np.inf), np.zeros(lead + (tq, 1)), np.zeros(lead + (tq, hs))
    with np.errstate(all="ignore"):
        for s, v, diag in blocks:
            m, l, o = (np.asarray(a) for a in S.merge_block(m, l, o, s.copy(), v, diag))
        y, lse = S.finish(m, l, o)
    return y, lse


def _softmax(blocks):
    """y, lse of softmax over all the blocks' keys at once, the diagonal one masked."""
    s = np.concatenate([np.where(np.triu(np.ones(b[0].shape[-2:], bool), 1), -np.inf, b[0]) if b[2] else b[0]
                        for b in blocks], axis=-1)
    v = np.concatenate([b[1] for b in blocks], axis=-2)
    mx = s.max(axis=-1, keepdims=True)
    e = np.exp(s - mx)
    return (e @ v) / e.sum(axis=-1, keepdims=True), mx + np.log(e.sum(axis=-1, keepdims=True))


def _blocks(rng, shift=None, lead=(2, 3), tq=4, hs=5):
    """{name: (scores, values, diagonal)}: the diagonal block and two full ones of 3 and 6 keys."""
    shift = shift or {}
    out = {}
    for name, tk, diag in (("diagonal", tq, True), ("A", 3, False), ("B", 6, False)):
        s = rng.standard_normal(lead + (tq, tk)) * 2 + shift.get(name, 0.0) + (1.5 if name == "B" else 0.0)
        out[name] = (s, rng.standard_normal(lead + (tk, hs)), diag)
    return out


def _compare(S, blk, order, what, hs=5):
    y, lse = _merged(S, [blk[k] for k in order], hs)
    want_y, want_lse = _softmax([blk[k] for k in order])
    _finite_close(y, want_y, f"{what}, blocks in the order {', '.join(order)}: y")
    _finite_close(lse, want_lse, f"{what}, blocks in the order {', '.join(order)}: the log-sum-exp lse")


def _student_ring(S):
    """pdist's RingAttention, its forward's merge the student's (its backward pdist's)."""
    from pdist.engine.attention import _heads, _views
    from pdist.engine.backend import xp
    from pdist.parallel.context import ring_attention as R
    from pdist.parallel.context.zigzag import block_pairs, segments

    class _StudentRing(R.RingAttention):
        def forward(self, *arrays, n_head, n_kv_head=None, group, layout="contiguous"):
            n_kv = n_kv_head or n_head
            q5, k5, v5 = _views(arrays, n_head, n_kv)                        # (B, n_kv, g, Tl, hs)
            B, _, g, Tl, hs = q5.shape
            self.arrays, self.n_head, self.n_kv, self.group, self.layout = arrays, n_head, n_kv, group, layout
            self.T, self.scale, cp = Tl * group.size, 1.0 / math.sqrt(hs), group.size
            qsegs = segments(self.T, cp, group.rank, layout)
            kv = cur = xp.ascontiguousarray(xp.stack([k5[:, :, 0], v5[:, :, 0]]))
            m = xp.full((B, n_kv, g, Tl, 1), -xp.inf, dtype=q5.dtype)
            l, o = xp.zeros_like(m), xp.zeros((B, n_kv, g, Tl, hs), dtype=q5.dtype)
            for step in range(cp):
                nxt, works = self._ring(cur, R.KV_TAG) if step < cp - 1 else (None, [])
                for qs, ks, diag in block_pairs(qsegs, self._kseg(step)):
                    s = R._scores(q5, cur[0], qs, ks, False, self.scale)     # unmasked: the student masks
                    got = S.merge_block(m[..., qs, :].copy(), l[..., qs, :].copy(), o[..., qs, :].copy(), s,
                                        cur[1][:, :, None, ks], diag)
                    m[..., qs, :], l[..., qs, :], o[..., qs, :] = got
                for w in works:
                    w.wait()
                cur = nxt
            y5, lse = S.finish(m, l, o)
            need(np.shape(y5) == o.shape and np.shape(lse) == m.shape,
                 f"finish returned y {np.shape(y5)} and lse {np.shape(lse)}, expected {o.shape} and {m.shape}")
            y = xp.empty((B, Tl, n_head * hs), dtype=q5.dtype)
            _heads(y, n_kv, g)[...] = y5
            self.kv, self.y, self.lse = kv, y, xp.asarray(lse)
            return y

    return _StudentRing


def _ring_case(Ring, g, layout, fused, T=12, n_head=4, hs=3):
    """One attention call on this rank's tokens vs pdist's attention on the whole sequence."""
    from pdist.engine import attention
    from pdist.engine.autograd import Tensor
    from pdist.parallel.context.zigzag import positions
    n_kv = n_head if fused else 2
    rng = np.random.default_rng([5, g.size, fused])              # the same on every rank of a group
    full = [rng.standard_normal((2, T, w * hs)) for w in (n_head, n_kv, n_kv)]
    G = rng.standard_normal((2, T, n_head * hs))
    ins = [Tensor(np.concatenate(full, -1) if fused else a, requires_grad=True) for a in ([0] if fused else full)]
    ref = attention.CausalAttention.apply(*ins, n_head=n_head, n_kv_head=n_kv)
    ref.backward(G)
    pos = positions(T, g.size, g.rank, layout)
    mine = [Tensor(np.ascontiguousarray(t.data[:, pos]), requires_grad=True) for t in ins]
    with np.errstate(all="ignore"):
        y = Ring.apply(*mine, n_head=n_head, n_kv_head=n_kv, group=g, layout=layout)
        y.backward(np.ascontiguousarray(G[:, pos]))
    what = f"ring attention, cp = {g.size}, {layout} chunks, {'fused qkv' if fused else 'grouped-query q, k, v'}"
    _finite_close(y.data, ref.data[:, pos], f"{what}: y on rank {g.rank}")
    for name, a, b in zip(("dqkv",) if fused else ("dQ", "dK", "dV"), mine, ins):
        _finite_close(a.grad, b.grad[:, pos], f"{what}: {name} on rank {g.rank} (backward reads your lse)")


def checks_11(S, world):
    from pdist.course.common import equal_to_one_process, tiny_cfg
    Ring = _student_ring(S)

    def blocks_any_order():
        blk = _blocks(np.random.default_rng(11))
        _compare(S, blk, ("A",), "one full block")
        _compare(S, blk, ("diagonal",), "the diagonal block alone (causal: key j hidden from query i when j > i)")
        _compare(S, blk, ("A", "B"), "two full blocks, the larger scores second")
        for order in itertools.permutations(blk):
            _compare(S, blk, order, "three blocks")

    def large_scores():
        blk = _blocks(np.random.default_rng(12), shift={"A": 1000.0})
        _compare(S, blk, ("B", "A"), "large scores (block A near 1000, B near 0), the block near 1000 last")
        _compare(S, blk, ("A", "B"), "large scores (block A near 1000, B near 0), the block near 1000 first")

    def ring():
        for g in sub_groups(world, (2,)):       # cp = 2 (and 1), then the world (3)
            for layout in ("contiguous", "zigzag"):
                for fused in (True, False):
                    _ring_case(Ring, g, layout, fused)

    def training():
        from pdist import comm
        from pdist.models.gpt import GPT
        from pdist.parallel import parallelize
        from pdist.parallel.context import context_parallel as cp_mod
        keep = cp_mod.ring_attention
        cp_mod.ring_attention = lambda *t, n_head, n_kv_head=None, group, layout: Ring.apply(
            *t, n_head=n_head, n_kv_head=n_kv_head, group=group, layout=layout)
        try:
            cfg, tokens = tiny_cfg(block_size=12)
            model = parallelize(GPT(cfg, seed=SEED), comm.DeviceMesh(cp=world.size), context_parallel="ring-zigzag")
            with np.errstate(all="ignore"):
                equal_to_one_process(model, cfg, tokens)
        except CheckFailed as e:
            raise CheckFailed(f"GPT-2 under context_parallel='ring-zigzag' (cp = {world.size}): {e}", e.detail) from None
        finally:
            cp_mod.ring_attention = keep

    return [("blocks merged in any order equal the softmax over all keys (y and lse)", blocks_any_order),
            ("scores near 1000, in either order: finite and exact", large_scores),
            ("plugged into ring attention: y, dQ, dK, dV equal whole-sequence attention (cp 1, 2, 3)", ring),
            ("GPT-2 trained under ring-zigzag context parallelism equals one process", training)]
