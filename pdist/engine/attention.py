"""Causal self-attention as one Function, multi-head or grouped-query: no head transposes, no
copies of q, k, v, and no work on the masked half of the scores.

n_head query heads share n_kv_head key/value heads, g = n_head / n_kv_head each
(grouped-query attention, Ainslie et al., 2023; g = 1 is multi-head, Vaswani et al., 2017):
query head h reads kv head j = h // g, as Hugging Face's ``repeat_kv``. Per query head h:

    q_h, k_j, v_j = views of the inputs                   # (B, T, hs), strided, not copied
    P_h = softmax(q_h k_j^T / sqrt(hs) + M)               # (B, T, T), M_ij = -inf for j > i
    y[:, t, h hs:(h+1) hs] = (P_h v_j)[:, t]               # written straight into (B, T, n_head hs)

Backward, with G_h the slice of dL/dy for head h and s = 1/sqrt(hs):

    dP_h = G_h v_j^T,   dS_h = P_h (dP_h - rowsum(dP_h P_h)),   dq_h = s dS_h k_j
    dv_j = sum_{h -> j} P_h^T G_h,   dk_j = s sum_{h -> j} dS_h^T q_h

each written into its slot of the gradient arrays. The heads are (B, n_kv_head, g, T, hs)
views, k and v (B, n_kv_head, 1, T, hs) broadcast over the g query heads of their group, so
no key or value is repeated. A group's sum is one GEMM: its g blocks of P (or dS) lie side
by side already, against the g slices of G (or q) stacked (copied when g > 1; g = 1 is a view).

Two entry points, one Function:

    causal_self_attention(qkv, n_head, n_kv_head=None)  qkv (B, T, (n_head + 2 n_kv_head) hs), fused
                                                        [Q | K | V] (GPT-2's c_attn output)
    causal_attention(q, k, v, n_head, n_kv_head=None)   q (B, T, n_head hs), k, v (B, T, n_kv_head hs)
                                                        (Llama's q_proj, k_proj, v_proj after RoPE)

``n_head`` and ``n_kv_head`` are the heads this module holds (a tensor-parallel rank: / tp).

Causal blocks (as FlashAttention skips masked tiles, Dao et al., 2022). The queries are cut
into blocks of ``QBLOCK`` rows; block [lo, hi) sees keys [0, hi) only, since every later key
is masked (P = 0 there). So the block's scores are a (hi - lo, hi) array, and every product
and pass above runs on (n + 1) / 2n of the T x T scores (n blocks: 5/8 at T = 256), the
blocks kept apart (``P`` is a list of contiguous arrays: ``saved_scores``). Backward runs the
blocks last first: the last sees all T keys and writes dv, dk; each earlier one adds its
(hi, hs) share into their first hi rows. On the host the batch is also cut into chunks whose
T x T scores take about ``CHUNK_BYTES``, so a block's passes stay in cache. Measured in
docs/performance.md. On a device (CuPy arrays) the same blocks run heads first, each product
one strided-batched 2-D GEMM over the whole batch, TF32 or bf16 tensor cores where allowed
(pdist/engine/attention_device.py, blocks of ``DEVICE_QBLOCK`` rows).
"""
import math

from pdist.engine import attention_device
from pdist.engine.autograd import Function
from pdist.engine.backend import is_device_array, is_gpu, xp
from pdist.engine.functional import causal_mask
from pdist.engine.reductions import row_dots, row_sums

QBLOCK = 64  # query rows per causal block on the host
CHUNK_BYTES = 1 << 21  # a batch chunk's T x T scores on the host: about one core's L2


def _heads(a, n_kv, g):
    """(B, T, n_kv g hs) -> a (B, n_kv, g, T, hs) view: query heads (g per kv head), or k, v (g = 1)."""
    B, T, W = a.shape
    return a.reshape(B, T, n_kv, g, W // (n_kv * g)).transpose(0, 2, 3, 1, 4)


def _views(arrays, n_head, n_kv):
    """q (B, n_kv, g, T, hs), k, v (B, n_kv, 1, T, hs): views of the fused qkv or of q, k, v."""
    if len(arrays) == 1 and n_kv == n_head and arrays[0].shape[-1] % (3 * n_head) == 0:
        B, T, W = arrays[0].shape  # multi-head fused [Q | K | V]: one reshape
        v6 = arrays[0].reshape(B, T, 3, n_head, 1, W // (3 * n_head)).transpose(2, 0, 3, 4, 1, 5)
        return v6[0], v6[1], v6[2]
    q, k, v = _split(arrays, n_head, n_kv)
    return _heads(q, n_kv, n_head // n_kv), _heads(k, n_kv, 1), _heads(v, n_kv, 1)


def _split(arrays, n_head, n_kv):
    """q, k, v (B, T, width) from the fused qkv or the three arrays, checking their widths."""
    if len(arrays) == 1:
        (qkv,) = arrays
        W = qkv.shape[-1]
        if W % (n_head + 2 * n_kv):
            raise ValueError(f"attention: qkv width {W} is not (n_head {n_head} + 2 n_kv_head {n_kv}) x head size")
        hs = W // (n_head + 2 * n_kv)
        return qkv[..., :n_head * hs], qkv[..., n_head * hs:(n_head + n_kv) * hs], qkv[..., (n_head + n_kv) * hs:]
    q, k, v = arrays
    hs = q.shape[-1] // n_head
    if q.shape[-1] % n_head or k.shape != v.shape or k.shape[:-1] != q.shape[:-1] or k.shape[-1] != n_kv * hs:
        raise ValueError(f"attention: q {q.shape} must be (B, T, n_head {n_head} x hs) and k {k.shape}, "
                         f"v {v.shape} (B, T, n_kv_head {n_kv} x hs)")
    return q, k, v


def query_blocks(T, qblock=None):
    """(lo, hi) of each block of query rows; block [lo, hi) attends to keys [0, hi)."""
    qblock = qblock or QBLOCK
    return [(lo, min(T, lo + qblock)) for lo in range(0, T, qblock)]


def saved_scores(T, qblock=None):
    """Elements of P kept per (sequence, head): sum over blocks of (hi - lo) hi; T^2 for one
    block, about T^2 (n + 1) / 2n for n blocks (pdist.measure.activation_memory counts it).
    ``qblock`` None: the active device's blocks (``QBLOCK`` rows on the host,
    ``attention_device.DEVICE_QBLOCK`` on a GPU)."""
    if qblock is None and is_gpu():
        qblock = attention_device.DEVICE_QBLOCK
    return sum((hi - lo) * hi for lo, hi in query_blocks(T, qblock))


def _layout(B, T, n_head, q):
    """(query blocks, batch chunks) for B sequences of T tokens on the host."""
    rows = max(1, CHUNK_BYTES // (n_head * T * T * q.itemsize))  # batch rows per chunk
    return query_blocks(T), [(b, min(B, b + rows)) for b in range(0, B, rows)]


class CausalAttention(Function):
    """y = concat_h softmax(q_h k_{h//g}^T / sqrt(hs) + M) v_{h//g} -> (B, T, n_head hs), from a
    fused qkv or from q, k, v. See the module docstring for both directions and the blocks."""
    fresh_grads = True

    def forward(self, *arrays, n_head, n_kv_head=None):
        n_kv = n_kv_head or n_head
        if n_kv < 1 or n_head % n_kv:
            raise ValueError(f"attention: n_head {n_head} must be a multiple of n_kv_head {n_kv}")
        q5, k5, v5 = _views(arrays, n_head, n_kv)  # (B, n_kv, g, T, hs), (B, n_kv, 1, T, hs) x 2
        B, _, g, T, hs = q5.shape
        self.scale = scale = 1.0 / math.sqrt(hs)
        self.arrays, self.n_head, self.n_kv = arrays, n_head, n_kv
        if is_device_array(q5):
            y = xp.empty((B, T, n_head * hs), dtype=q5.dtype)
            self.P = attention_device.forward(q5, k5, v5, y, scale)
            return y
        blocks, chunks = _layout(B, T, n_head, q5)
        P = [xp.empty((B, n_kv, g, hi - lo, hi), dtype=q5.dtype) for lo, hi in blocks]
        y = xp.empty((B, T, n_head * hs), dtype=q5.dtype)
        y5 = _heads(y, n_kv, g)  # (B, n_kv, g, T, hs) view of y
        for b0, b1 in chunks:
            for (lo, hi), Pi in zip(blocks, P):
                a = Pi[b0:b1]  # (b, n_kv, g, hi - lo, hi)
                xp.matmul(q5[b0:b1, :, :, lo:hi], xp.swapaxes(k5[b0:b1, :, :, :hi], -1, -2), out=a)
                a *= scale
                a[..., lo:hi] += causal_mask(hi - lo, hi - lo, a.dtype)  # the diagonal tile
                a -= a.max(axis=-1, keepdims=True)
                xp.exp(a, out=a)
                a /= row_sums(a)  # P
                xp.matmul(a, v5[b0:b1, :, :, :hi], out=y5[b0:b1, :, :, lo:hi])
        self.P = P
        return y

    def backward(self, grad):
        P, nh, n_kv, s = self.P, self.n_head, self.n_kv, self.scale
        q5, k5, v5 = _views(self.arrays, nh, n_kv)
        grads = tuple(xp.empty_like(a) for a in self.arrays)  # shaped like qkv, or like q, k, v
        gq5, gk5, gv5 = _views(grads, nh, n_kv)
        gk4, gv4 = gk5[:, :, 0], gv5[:, :, 0]  # (B, n_kv, T, hs)
        B, _, g, T, _ = q5.shape
        if is_device_array(q5):
            attention_device.backward(P, grad, q5, k5, v5, gq5, gk4, gv4, s)
            self.P = None
            return grads
        gy = _heads(xp.ascontiguousarray(grad), n_kv, g)  # (B, n_kv, g, T, hs) view
        blocks, chunks = _layout(B, T, nh, q5)
        for b0, b1 in chunks:
            c = slice(b0, b1)
            for (lo, hi), Pi in reversed(list(zip(blocks, P))):
                a, gyi = Pi[c], gy[c, :, :, lo:hi]  # (b, n_kv, g, hi - lo, hi), (b, n_kv, g, hi - lo, hs)
                _add_into(gv4[c, :, :hi], _keys_first(a), _stacked(gyi), first=hi == T)  # dv = sum P^T G
                dp = gyi @ xp.swapaxes(v5[c, :, :, :hi], -1, -2)  # dP = G v^T, (b, n_kv, g, hi - lo, hi)
                dp -= row_dots(dp, a)
                dp *= a  # dS = P (dP - rowsum(dP P))
                xp.matmul(dp, k5[c, :, :, :hi], out=gq5[c, :, :, lo:hi])
                _add_into(gk4[c, :, :hi], _keys_first(dp), _stacked(q5[c, :, :, lo:hi]), first=hi == T)
            gq5[c] *= s  # dq = s dS k
            gk4[c] *= s  # dk = s sum dS^T q
        self.P = None
        return grads


def _keys_first(a):
    """A group's g score blocks side by side, keys first: (b, n_kv, g, m, n) -> (b, n_kv, n, g m), a view."""
    b, n_kv, g, m, n = a.shape
    return xp.swapaxes(a.reshape(b, n_kv, g * m, n), -1, -2)


def _stacked(x):
    """A group's g row blocks stacked: (b, n_kv, g, m, hs) -> (b, n_kv, g m, hs) (a view when g = 1)."""
    b, n_kv, g, m, hs = x.shape
    return x.reshape(b, n_kv, g * m, hs)


def _add_into(out, a, b, first):
    """out = a @ b when first (the block that sees every key), else out += a @ b."""
    if first:
        xp.matmul(a, b, out=out)
    else:
        out += a @ b


def causal_self_attention(qkv, n_head, n_kv_head=None):
    """Fused causal attention: qkv (B, T, (n_head + 2 n_kv_head) hs) Tensor -> (B, T, n_head hs).
    ``n_kv_head`` None: multi-head (n_kv_head = n_head, qkv (B, T, 3 n_head hs))."""
    return CausalAttention.apply(qkv, n_head=n_head, n_kv_head=n_kv_head)


def causal_attention(q, k, v, n_head, n_kv_head=None):
    """Causal grouped-query attention: q (B, T, n_head hs), k, v (B, T, n_kv_head hs) Tensors ->
    (B, T, n_head hs); query head h reads kv head h // (n_head / n_kv_head)."""
    return CausalAttention.apply(q, k, v, n_head=n_head, n_kv_head=n_kv_head)


__all__ = ["causal_self_attention", "causal_attention", "CausalAttention", "query_blocks", "saved_scores"]
