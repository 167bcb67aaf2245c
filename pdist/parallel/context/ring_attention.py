"""Ring attention: causal attention over a sequence cut across the cp ranks of a ring
(Liu et al., 2023, "Ring Attention with Blockwise Transformers"), merged by the online
softmax of FlashAttention (Dao et al., 2022).

Rank r holds the queries, keys and values of its tokens (``zigzag.segments``: the global
positions it holds, a list of equal chunks). Its Q stays; the K/V chunks travel round the
ring (rank r sends to r + 1, receives from r - 1), so at step s = 0 .. cp-1 rank r holds
the K/V of rank (r - s) mod cp. The next chunk's isend/irecv are posted before the block
is computed, so the transfer overlaps the work. Per query row i and block b of keys, with
scores S_b = q K_b^T / sqrt(hs) + M (M_ij = -inf where key j is after query i):

    m' = max(m, rowmax S_b),   l' = e^(m - m') l + rowsum e^(S_b - m'),
    o' = e^(m - m') o + e^(S_b - m') V_b,      y = o / l,   lse = m + log l

which is softmax(q K^T + M) V over all keys, exactly, whatever the order of the blocks.
Backward (FlashAttention's), with G = dL/dy and D = rowsum(G * y): per block,
P_b = e^(S_b - lse), dV_b = P_b^T G, dS_b = P_b (G V_b^T - D), dq += s dS_b K_b,
dK_b = s dS_b^T q. The K/V chunks circulate again; the dK/dV of chunk j start at rank
j + 1, travel with it, and arrive home at rank j after cp - 1 hops, where the owner adds
its own share. Per attention layer each rank sends (cp - 1) K/V chunks forward, (cp - 1)
K/V chunks and (cp - 1) dK/dV chunks backward (``ring_bytes``).

Causal skipping and load balance (zigzag.py). A (query chunk, key chunk) pair whose keys
all come after its queries is skipped, the diagonal pair is masked, every other pair is
full. Cut in cp contiguous chunks (``layout="contiguous"``), rank r computes r + 1 chunk
pairs, so the last rank works cp times as much as the first; zigzag (``layout="zigzag"``,
Megatron's and Llama 3's head-tail split) gives every rank 2 cp + 1 pairs of half-size chunks.
The statistics m, l and the output o accumulate in the inputs' dtype, the compute dtype
(float32 or float64: under bf16/fp16 mixed precision, pdist/engine/precision.py keeps
attention and its softmax out of the low dtype). Under tensor parallelism the inputs hold
this tp rank's heads, and the bytes are ``ring_bytes`` with n_kv_head/tp.
Heads as in pdist/engine/attention.py: grouped-query, g = n_head / n_kv_head query heads
per kv head, q and k, v as (B, n_kv, g, T, hs) and (B, n_kv, 1, T, hs) views.
"""
import math

from pdist.engine.attention import _heads, _views
from pdist.engine.autograd import Function
from pdist.engine.backend import xp
from pdist.engine.functional import causal_mask
from pdist.parallel.context.zigzag import block_pairs, segments

KV_TAG, DKV_TAG = 71, 72
work = {"scores": 0}  # (query, key) score elements this process's forward computed, per sequence and head


def ring_bytes(B, T, cp, n_kv_head, head_size, itemsize):
    """(forward, backward) bytes each rank sends per attention layer: (cp - 1) K/V chunks,
    and backward (cp - 1) K/V chunks plus (cp - 1) dK/dV chunks."""
    chunk = 2 * B * (T // cp) * n_kv_head * head_size * itemsize
    return (cp - 1) * chunk, 2 * (cp - 1) * chunk


def _scores(q5, k4, qs, ks, diag, scale):
    """S = q K^T s (+ the causal mask on the diagonal chunk): (B, n_kv, g, tq, tk)."""
    a = q5[:, :, :, qs] @ xp.swapaxes(k4[:, :, None, ks], -1, -2)
    a *= scale
    if diag:
        a += causal_mask(a.shape[-2], a.shape[-1], a.dtype)
    return a


def _merge(q5, kv, pairs, m, l, o, scale):
    """Fold one K/V chunk into the running max m, sum l and output o (online softmax)."""
    for qs, ks, diag in pairs:
        a = _scores(q5, kv[0], qs, ks, diag, scale)
        work["scores"] += a.shape[-2] * a.shape[-1]
        m_new = xp.maximum(m[..., qs, :], a.max(axis=-1, keepdims=True))
        alpha = xp.exp(m[..., qs, :] - m_new)
        a -= m_new
        xp.exp(a, out=a)
        l[..., qs, :] = alpha * l[..., qs, :] + a.sum(axis=-1, keepdims=True)
        o[..., qs, :] = alpha * o[..., qs, :] + a @ kv[1][:, :, None, ks]
        m[..., qs, :] = m_new


def _block_grads(q5, kv, pairs, lse, gy, D, dq, dkv, scale):
    """One chunk's share: dq += s dS K, dK = s sum_g dS^T q, dV = sum_g P^T G."""
    for qs, ks, diag in pairs:
        p = _scores(q5, kv[0], qs, ks, diag, scale)
        p -= lse[..., qs, :]
        xp.exp(p, out=p)  # P (b, n_kv, g, tq, tk)
        g = gy[:, :, :, qs]
        dkv[1][:, :, ks] += (xp.swapaxes(p, -1, -2) @ g).sum(axis=2)
        dp = g @ xp.swapaxes(kv[1][:, :, None, ks], -1, -2)
        dp -= D[..., qs, :]
        dp *= p  # dS
        dq[:, :, :, qs] += scale * (dp @ kv[0][:, :, None, ks])
        dkv[0][:, :, ks] += scale * (xp.swapaxes(dp, -1, -2) @ q5[:, :, :, qs]).sum(axis=2)


class RingAttention(Function):
    """y = causal attention of this rank's queries over every rank's keys (see the module
    docstring), from a fused qkv or from q, k, v, each (B, T/cp, width) of this rank's tokens."""
    fresh_grads = True

    def _ring(self, buf, tag):
        """Post the exchange of ``buf`` round the ring: (received buffer, works). One batch (over
        NCCL one group call: a lone NCCL send or receive would block its stream until matched)."""
        g, nxt = self.group, xp.empty(buf.shape, dtype=buf.dtype)
        works = g.batch_isend_irecv([("recv", nxt, (g.rank - 1) % g.size, tag),
                                     ("send", buf, (g.rank + 1) % g.size, tag)])
        return nxt, works

    def _kseg(self, step):
        return segments(self.T, self.group.size, (self.group.rank - step) % self.group.size, self.layout)

    def forward(self, *arrays, n_head, n_kv_head=None, group, layout="contiguous"):
        n_kv = n_kv_head or n_head
        q5, k5, v5 = _views(arrays, n_head, n_kv)  # (B, n_kv, g, Tl, hs), (B, n_kv, 1, Tl, hs) x 2
        B, _, g, Tl, hs = q5.shape
        self.arrays, self.n_head, self.n_kv, self.group, self.layout = arrays, n_head, n_kv, group, layout
        self.T, self.scale, cp = Tl * group.size, 1.0 / math.sqrt(hs), group.size
        qsegs = segments(self.T, cp, group.rank, layout)
        kv = xp.ascontiguousarray(xp.stack([k5[:, :, 0], v5[:, :, 0]]))  # (2, B, n_kv, Tl, hs), contiguous: what travels
        m = xp.full((B, n_kv, g, Tl, 1), -xp.inf, dtype=q5.dtype)
        l, o = xp.zeros_like(m), xp.zeros((B, n_kv, g, Tl, hs), dtype=q5.dtype)
        cur = kv
        for s in range(cp):
            nxt, works = self._ring(cur, KV_TAG) if s < cp - 1 else (None, [])
            _merge(q5, cur, block_pairs(qsegs, self._kseg(s)), m, l, o, self.scale)
            for w in works:
                w.wait()
            cur = nxt
        o /= l
        y = xp.empty((B, Tl, n_head * hs), dtype=q5.dtype)
        _heads(y, n_kv, g)[...] = o
        self.kv, self.y, self.lse = kv, y, m + xp.log(l)  # kept: K/V (2 N h), y (its consumer's too), lse
        return y

    @staticmethod
    def _kv_for_step(previous, received):
        """The K/V chunk backward computes with at the next step: the one just received."""
        return received

    def backward(self, grad):
        q5 = _views(self.arrays, self.n_head, self.n_kv)[0]
        g, cp, scale = q5.shape[2], self.group.size, self.scale
        gy = _heads(xp.ascontiguousarray(grad), self.n_kv, g)  # (B, n_kv, g, Tl, hs)
        D = (gy * _heads(self.y, self.n_kv, g)).sum(axis=-1, keepdims=True)  # rowsum(G * y)
        dq = xp.zeros(gy.shape, dtype=gy.dtype)
        qsegs = segments(self.T, cp, self.group.rank, self.layout)
        cur, own, sends, acc = self.kv, None, [], None
        for s in range(cp):
            nxt, works = self._ring(cur, KV_TAG) if s < cp - 1 else (None, [])
            dkv = xp.zeros(cur.shape, dtype=cur.dtype)  # this rank's share of chunk (r - s)'s dK, dV
            _block_grads(q5, cur, block_pairs(qsegs, self._kseg(s)), self.lse, gy, D, dq, dkv, scale)
            if s == 0:
                own = dkv
            else:
                if acc is not None:  # the sum so far, from the ranks before
                    acc[1].wait()
                    dkv += acc[0]
                buf, (recv, send) = self._ring(dkv, DKV_TAG)  # on to r + 1; the next sum from r - 1
                sends.append(send)
                acc = (buf, recv)
            for w in works:
                w.wait()
            cur = self._kv_for_step(cur, nxt)
        if acc is not None:  # chunk r's dK, dV home from rank r - 1
            acc[1].wait()
            own += acc[0]
        for w in sends:
            w.wait()
        return self._grads(dq, own)

    def _grads(self, dq, dkv):
        grads = tuple(xp.empty_like(a) for a in self.arrays)  # shaped like qkv, or like q, k, v
        gq5, gk5, gv5 = _views(grads, self.n_head, self.n_kv)
        gq5[...] = dq
        gk5[:, :, 0] = dkv[0]
        gv5[:, :, 0] = dkv[1]
        self.kv = self.y = self.lse = self.arrays = None
        return grads


def ring_attention(*tensors, n_head, n_kv_head=None, group, layout="contiguous"):
    """Ring attention of this rank's tokens: a fused qkv (B, T/cp, (n_head + 2 n_kv_head) hs),
    or q, k, v, as ``pdist.engine.attention``'s entry points -> (B, T/cp, n_head hs)."""
    return RingAttention.apply(*tensors, n_head=n_head, n_kv_head=n_kv_head, group=group, layout=layout)


__all__ = ["ring_attention", "RingAttention", "ring_bytes", "work"]
