"""Multi-head causal self-attention as one Function: no head transposes, no copies of q, k, v,
and no work on the masked half of the scores.

With qkv (B, T, 3 nh hs) the output of c_attn, per head h (Vaswani et al., 2017):

    q_h, k_h, v_h = views of qkv                          # (B, nh, T, hs), strided, not copied
    P_h = softmax(q_h k_h^T / sqrt(hs) + M)              # (B, nh, T, T), M_ij = -inf for j > i
    y[:, t, h hs:(h+1) hs] = (P_h v_h)[:, t]              # written straight into (B, T, C)

Backward, with G_h the slice of dL/dy for head h and s = 1/sqrt(hs):

    dv_h = P_h^T G_h,   dP_h = G_h v_h^T,   dS_h = P_h (dP_h - rowsum(dP_h P_h))
    dq_h = s dS_h k_h,  dk_h = s dS_h^T q_h

each written into its slot of one gradient array shaped like qkv.

Causal blocks (as FlashAttention skips masked tiles, Dao et al., 2022). The queries are cut
into blocks of ``QBLOCK`` rows; block [lo, hi) sees keys [0, hi) only, since every later key
is masked (P = 0 there). So the block's scores are a (hi - lo, hi) array, and every product
and pass above runs on (n + 1) / 2n of the T x T scores (n blocks: 5/8 at T = 256), the
blocks kept apart (``P`` is a list of contiguous arrays: ``saved_scores``). Backward runs the
blocks last first: the last sees all T keys and writes dv, dk; each earlier one adds its
(hi, hs) share into their first hi rows. On the host the batch is also cut into chunks whose
T x T scores take about ``CHUNK_BYTES``, so a block's passes stay in cache. On a device the whole
(B, nh, T, T) runs as one block (fewer, larger kernels). Measured in docs/performance.md.
"""
import math

from pdist.engine.autograd import Function
from pdist.engine.backend import is_device_array, xp
from pdist.engine.functional import causal_mask, row_dots, row_sums

QBLOCK = 64  # query rows per causal block on the host
CHUNK_BYTES = 1 << 21  # a batch chunk's T x T scores on the host: about one core's L2


def _heads(a, n_head):
    """q, k, v as strided views (B, nh, T, hs) of a (B, T, 3 nh hs) array."""
    B, T, C3 = a.shape
    hs = C3 // (3 * n_head)
    v5 = a.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)  # (3, B, nh, T, hs), a view
    return v5[0], v5[1], v5[2]


def query_blocks(T, qblock=None):
    """(lo, hi) of each block of query rows; block [lo, hi) attends to keys [0, hi)."""
    qblock = qblock or QBLOCK
    return [(lo, min(T, lo + qblock)) for lo in range(0, T, qblock)]


def saved_scores(T, qblock=None):
    """Elements of P kept per (sequence, head): sum over blocks of (hi - lo) hi; T^2 for one
    block, about T^2 (n + 1) / 2n for n blocks (pdist.measure.activation_memory counts it)."""
    return sum((hi - lo) * hi for lo, hi in query_blocks(T, qblock))


def _layout(qkv, n_head):
    """(query blocks, batch chunks) for this array: one of each on a device."""
    B, T, _ = qkv.shape
    if is_device_array(qkv):
        return [(0, T)], [(0, B)]
    rows = max(1, CHUNK_BYTES // (n_head * T * T * qkv.itemsize))  # batch rows per chunk
    return query_blocks(T), [(b, min(B, b + rows)) for b in range(0, B, rows)]


class CausalSelfAttention(Function):
    """y = concat_h softmax(q_h k_h^T / sqrt(hs) + M) v_h from qkv (B, T, 3C) -> (B, T, C).
    See the module docstring for the math of both directions and the causal blocks."""
    fresh_grads = True


    def forward(self, qkv, n_head):
        B, T, C3 = qkv.shape
        if C3 % (3 * n_head):
            raise ValueError(f"attention: qkv width {C3} is not 3 x n_head ({n_head}) x head size")
        hs, C = C3 // (3 * n_head), C3 // 3
        q, k, v = _heads(qkv, n_head)  # (B, nh, T, hs) views
        self.scale = scale = 1.0 / math.sqrt(hs)
        blocks, chunks = _layout(qkv, n_head)
        P = [xp.empty((B, n_head, hi - lo, hi), dtype=qkv.dtype) for lo, hi in blocks]
        y = xp.empty((B, T, C), dtype=qkv.dtype)
        yh = y.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) view of y
        for b0, b1 in chunks:
            for (lo, hi), Pi in zip(blocks, P):
                a = Pi[b0:b1]  # (b, nh, hi - lo, hi)
                xp.matmul(q[b0:b1, :, lo:hi], xp.swapaxes(k[b0:b1, :, :hi], -1, -2), out=a)
                a *= scale
                a[..., lo:hi] += causal_mask(hi - lo, hi - lo, a.dtype)  # the diagonal tile
                a -= a.max(axis=-1, keepdims=True)
                xp.exp(a, out=a)
                a /= row_sums(a)  # P
                xp.matmul(a, v[b0:b1, :, :hi], out=yh[b0:b1, :, lo:hi])
        self.qkv, self.P, self.n_head = qkv, P, n_head
        return y

    def backward(self, g):
        qkv, P, nh, s = self.qkv, self.P, self.n_head, self.scale
        B, T, C3 = qkv.shape
        hs = C3 // (3 * nh)
        gy = xp.ascontiguousarray(g).reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) view
        q, k, v = _heads(qkv, nh)
        gqkv = xp.empty_like(qkv)  # (B, T, 3C)
        gq, gk, gv = _heads(gqkv, nh)
        blocks, chunks = _layout(qkv, nh)
        for b0, b1 in chunks:
            c = slice(b0, b1)
            for (lo, hi), Pi in reversed(list(zip(blocks, P))):
                a, gyi = Pi[c], gy[c, :, lo:hi]  # (b, nh, hi - lo, hi), (b, nh, hi - lo, hs)
                _add_into(gv[c, :, :hi], xp.swapaxes(a, -1, -2), gyi, first=hi == T)  # dv = P^T G
                dp = gyi @ xp.swapaxes(v[c, :, :hi], -1, -2)  # dP = G v^T, (b, nh, hi - lo, hi)
                dp -= row_dots(dp, a)
                dp *= a  # dS = P (dP - rowsum(dP P))
                xp.matmul(dp, k[c, :, :hi], out=gq[c, :, lo:hi])
                _add_into(gk[c, :, :hi], xp.swapaxes(dp, -1, -2), q[c, :, lo:hi], first=hi == T)
            gq[c] *= s  # dq = s dS k
            gk[c] *= s  # dk = s dS^T q
        return gqkv, None


def _add_into(out, a, b, first):
    """out = a @ b when first (the block that sees every key), else out += a @ b."""
    if first:
        xp.matmul(a, b, out=out)
    else:
        out += a @ b


def causal_self_attention(qkv, n_head):
    """Fused multi-head causal self-attention: qkv (B, T, 3 n_head hs) Tensor -> (B, T, n_head hs)."""
    return CausalSelfAttention.apply(qkv, n_head)
