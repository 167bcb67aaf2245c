"""Causal attention on a device (CuPy): query blocks with causal skipping, every product one
strided-batched 2-D GEMM (cuBLAS), the math of pdist/engine/attention.py.

Layout. q, k, v are copied once, heads first and contiguous: Q (B n_kv, T g, hs), the g query
heads of a kv group interleaved token-major (row t g + i is token t of query head j g + i),
K, V (B n_kv, T, hs). Then for query block [lo, hi) (m = hi - lo rows, the causal blocks of
FlashAttention, Dao et al., 2022; every key after hi is masked, so it is never touched):

    S = s Q[:, lo g : hi g] K[:, :hi]^T + M     # (B n_kv, m g, hi): ONE batched GEMM of 2-D
    P = softmax(S) (rows)                       # matrices, uniform batch strides, no copies
    Y[:, lo g : hi g] = P V[:, :hi]             # (B n_kv, m g, hs)

and backward, blocks last first (the last one sees every key and writes dV, dK; the
others add into their first hi rows), G the block's rows of dL/dY:

    dV[:, :hi] += P^T G,   dP = G V[:, :hi]^T,   dS = P (dP - rowsum(dP P))
    dQ[:, lo g : hi g] = s dS K[:, :hi],        dK[:, :hi] += s dS^T Q[:, lo g : hi g]

A group's g query heads share its K and V without a repeat: they are the g rows of each
token in the block. Work on the scores: sum over blocks of m hi = T^2 (n + 1) / 2n for n
blocks (5/8 at T 1024 with ``DEVICE_QBLOCK`` 256), the same saved P as on the host.

GEMM precision: float32 GEMMs run at CuPy's compute type for float32, TF32 tensor cores with
``CUPY_TF32=1`` or ``allow_tf32(True)`` (cuBLAS's CUBLAS_COMPUTE_32F_FAST_TF32: 10-bit
mantissa inputs, fp32 accumulate); bfloat16 operands (bf16 mixed precision: ``low_matmul``)
use bf16 tensor cores with fp32 accumulation. Row sums and the softmax are CuPy reduction
kernels in the arrays' dtype, never a GEMM, so TF32 touches only the products."""
from pdist.engine.backend import xp
from pdist.engine.functional import causal_mask

DEVICE_QBLOCK = 256  # query rows per causal block on a device (larger: fewer, larger kernels)


def allow_tf32(flag=True):
    """Let (True) or forbid (False) TF32 in every float32 GEMM of CuPy from now on (the explicit
    compute type; ``CUPY_TF32=1`` sets the same default at import). Returns the previous
    setting (True when it was TF32). Needs real CuPy; a no-op returning False elsewhere."""
    try:
        from cupy._core import _routines_linalg as L
    except ImportError:
        return False
    before = L.get_compute_type(xp.float32) == L.COMPUTE_TYPE_TF32
    L.set_compute_type(xp.float32, L.COMPUTE_TYPE_TF32 if flag else L.COMPUTE_TYPE_DEFAULT)
    return before


def low_matmul(a, b):
    """``a @ b`` for 2-byte-float-valued operands: the GEMM in bf16/fp16 (tensor cores, fp32
    accumulate, cuBLAS's default compute type for those dtypes), the result in float32.
    ``a``, ``b`` hold values already rounded to the low dtype ``b.dtype`` (mixed precision's
    inputs and weights), so the products are exact and only the sums' order and the one
    rounding of the output to the low dtype differ from the host's fp32 GEMM."""
    return (a.astype(b.dtype, copy=False) @ b).astype(xp.float32)


def blocks(T, qblock=None):
    qb = qblock or DEVICE_QBLOCK
    return [(lo, min(T, lo + qb)) for lo in range(0, T, qb)]


def _heads_first(q5, k5, v5):
    """Contiguous copies: Q (B n_kv, T g, hs), K, V (B n_kv, T, hs)."""
    B, n_kv, g, T, hs = q5.shape
    Q = xp.ascontiguousarray(q5.transpose(0, 1, 3, 2, 4)).reshape(B * n_kv, T * g, hs)
    K = xp.ascontiguousarray(k5[:, :, 0]).reshape(B * n_kv, T, hs)
    V = xp.ascontiguousarray(v5[:, :, 0]).reshape(B * n_kv, T, hs)
    return Q, K, V


def forward(q5, k5, v5, y, scale, qblock=None):
    """y (B, T, n_kv g hs) <- attention of the (B, n_kv, g, T, hs) views; returns the saved
    P blocks [(B n_kv, m g, hi)]."""
    B, n_kv, g, T, hs = q5.shape
    Q, K, V = _heads_first(q5, k5, v5)
    y6 = y.reshape(B, T, n_kv, g, hs)
    P = []
    for lo, hi in blocks(T, qblock):
        m = hi - lo
        s = xp.matmul(Q[:, lo * g:hi * g], xp.swapaxes(K[:, :hi], -1, -2))  # (B n_kv, m g, hi)
        s *= scale
        s4 = s.reshape(B * n_kv, m, g, hi)
        s4[..., lo:hi] += causal_mask(m, m, s.dtype)[:, None, :]  # the diagonal tile, every head
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        yb = xp.matmul(s, V[:, :hi])  # (B n_kv, m g, hs)
        y6[:, lo:hi] = yb.reshape(B, n_kv, m, g, hs).transpose(0, 2, 1, 3, 4)
        P.append(s)
    return P


def backward(P, grad, q5, k5, v5, gq5, gk4, gv4, scale, qblock=None):
    """Writes dq into the (B, n_kv, g, T, hs) view ``gq5`` and dk, dv into the (B, n_kv, T, hs)
    views ``gk4``, ``gv4``, from dL/dy ``grad`` (B, T, n_kv g hs)."""
    B, n_kv, g, T, hs = q5.shape
    Q, K, V = _heads_first(q5, k5, v5)
    G = xp.ascontiguousarray(grad.reshape(B, T, n_kv, g, hs).transpose(0, 2, 1, 3, 4)).reshape(B * n_kv, T * g, hs)
    dQ, dK, dV = xp.empty_like(Q), xp.empty_like(K), xp.empty_like(V)
    for (lo, hi), p in reversed(list(zip(blocks(T, qblock), P))):
        rows = slice(lo * g, hi * g)
        gb = G[:, rows]  # (B n_kv, m g, hs)
        _add(dV[:, :hi], xp.swapaxes(p, -1, -2), gb, first=hi == T)  # dV += P^T G
        dp = xp.matmul(gb, xp.swapaxes(V[:, :hi], -1, -2))  # dP = G V^T, (B n_kv, m g, hi)
        dp -= (dp * p).sum(axis=-1, keepdims=True)
        dp *= p  # dS
        dQ[:, rows] = xp.matmul(dp, K[:, :hi])
        _add(dK[:, :hi], xp.swapaxes(dp, -1, -2), Q[:, rows], first=hi == T)  # dK += dS^T Q
    dQ *= scale
    dK *= scale
    gq5[...] = dQ.reshape(B, n_kv, T, g, hs).transpose(0, 1, 3, 2, 4)
    gk4[...] = dK.reshape(B, n_kv, T, hs)
    gv4[...] = dV.reshape(B, n_kv, T, hs)


def _add(out, a, b, first):
    """out = a @ b when first (the block that sees every key), else out += a @ b."""
    if first:
        out[...] = xp.matmul(a, b)
    else:
        out += xp.matmul(a, b)


__all__ = ["DEVICE_QBLOCK", "allow_tf32", "low_matmul", "forward", "backward", "blocks"]
