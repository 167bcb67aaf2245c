"""Multi-head causal self-attention as one Function: no head transposes, no copies of q, k, v.

With qkv (B, T, 3 nh hs) the output of c_attn, per head h (Vaswani et al., 2017):

    q_h, k_h, v_h = views of qkv                          # (B, nh, T, hs), strided, not copied
    P_h = softmax(q_h k_h^T / sqrt(hs) + M)              # (B, nh, T, T), M_ij = -inf for j > i
    y[:, t, h hs:(h+1) hs] = (P_h v_h)[:, t]              # written straight into (B, T, C)

Backward, with G_h the slice of dL/dy for head h and s = 1/sqrt(hs):

    dv_h = P_h^T G_h,   dP_h = G_h v_h^T,   dS_h = P_h (dP_h - rowsum(dP_h P_h))
    dq_h = s dS_h k_h,  dk_h = s dS_h^T q_h

each written into its slot of one gradient array shaped like qkv. Composed from small ops
(reshape, permute, three slices, two matmuls, the softmax) the same computation copies qkv's
head layout out and back, and its backward builds three zero arrays the size of qkv (one per
slice) and sums them: the fused version saves those passes over memory
(docs/performance.md). ``P`` is the only activation kept besides qkv itself (the composed
graph keeps the same).
"""
import math

from pdist.autograd import Function
from pdist.backend import xp
from pdist.functional import causal_mask, row_dots, row_sums


def _heads(a, n_head):
    """q, k, v as strided views (B, nh, T, hs) of a (B, T, 3 nh hs) array."""
    B, T, C3 = a.shape
    hs = C3 // (3 * n_head)
    v5 = a.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # (3, B, nh, T, hs), a view
    return v5[0], v5[1], v5[2]


class CausalSelfAttention(Function):
    """y = concat_h softmax(q_h k_h^T / sqrt(hs) + M) v_h from qkv (B, T, 3C) -> (B, T, C).
    See the module docstring for the math of both directions."""

    def forward(self, qkv, n_head):
        B, T, C3 = qkv.shape
        if C3 % (3 * n_head):
            raise ValueError(f"attention: qkv width {C3} is not 3 x n_head ({n_head}) x head size")
        hs, C = C3 // (3 * n_head), C3 // 3
        q, k, v = _heads(qkv, n_head)  # (B, nh, T, hs) views
        self.scale = scale = 1.0 / math.sqrt(hs)
        att = q @ xp.swapaxes(k, -1, -2)  # (B, nh, T, T)
        att *= scale
        att += causal_mask(T, T, att.dtype)  # (T, T) broadcast over (B, nh)
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att /= row_sums(att)  # P
        y = xp.empty((B, T, C), dtype=qkv.dtype)
        xp.matmul(att, v, out=y.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3))  # (B, nh, T, hs) slots
        self.qkv, self.att, self.n_head = qkv, att, n_head
        return y

    def backward(self, g):
        qkv, att, nh, s = self.qkv, self.att, self.n_head, self.scale
        B, T, C3 = qkv.shape
        hs = C3 // (3 * nh)
        gy = xp.ascontiguousarray(g).reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) view
        q, k, v = _heads(qkv, nh)
        gqkv = xp.empty_like(qkv)  # (B, T, 3C)
        gq, gk, gv = _heads(gqkv, nh)
        xp.matmul(xp.swapaxes(att, -1, -2), gy, out=gv)  # dv = P^T G
        dp = gy @ xp.swapaxes(v, -1, -2)  # dP = G v^T, (B, nh, T, T)
        dp -= row_dots(dp, att)
        dp *= att  # dS = P (dP - rowsum(dP P))
        xp.matmul(dp, k, out=gq)
        gq *= s  # dq = s dS k
        xp.matmul(xp.swapaxes(dp, -1, -2), q, out=gk)
        gk *= s  # dk = s dS^T q
        return gqkv, None


def causal_self_attention(qkv, n_head):
    """Fused multi-head causal self-attention: qkv (B, T, 3 n_head hs) Tensor -> (B, T, n_head hs)."""
    return CausalSelfAttention.apply(qkv, n_head)
