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
import os

from pdist.engine.backend import xp
from pdist.engine.functional import causal_mask

DEVICE_QBLOCK = 256  # query rows per causal block on a device (larger: fewer, larger kernels)
_TF32 = [int(os.environ.get("CUPY_TF32", "0") or 0) > 0]  # float32 GEMMs on TF32 tensor cores
# CUDA's data-type codes (library_types.h), the ABI cuBLAS reads
_CUDA_TYPES = {"float32": ("CUDA_R_32F", 0), "float64": ("CUDA_R_64F", 1), "float16": ("CUDA_R_16F", 2),
               "bfloat16": ("CUDA_R_16BF", 14)}


def allow_tf32(flag=True):
    """Let (True) or forbid (False) TF32 tensor cores in float32 GEMMs from now on: attention's
    (``gemm``: CUBLAS_COMPUTE_32F_FAST_TF32, 10-bit mantissa inputs, fp32 accumulate) and CuPy's
    own 2-D ``matmul`` (its compute type for float32; ``CUPY_TF32=1`` sets both at import).
    Returns the previous setting. CuPy's batched (>2-D) matmul never uses TF32: it passes
    CUDA_R_32F as the compute type, which is why attention calls cuBLAS itself."""
    before, _TF32[0] = _TF32[0], bool(flag)
    try:
        from cupy._core import _routines_linalg as L
        L.set_compute_type(xp.float32, L.COMPUTE_TYPE_TF32 if flag else L.COMPUTE_TYPE_DEFAULT)
    except (ImportError, AttributeError):  # the strict stand-in: no CuPy internals
        pass
    return before


def _operand(a):
    """(pointer, ld, batch stride) of a (batch, rows, cols) array whose rows are contiguous."""
    st0, st1, st2 = a.strides
    isz = a.itemsize
    if st2 != isz or st1 % isz or st0 % isz or st1 // isz < a.shape[2]:
        raise ValueError(f"gemm: operand {a.shape} with strides {a.strides} has no contiguous rows")
    return a.data.ptr, st1 // isz, (st0 // isz if a.shape[0] > 1 else 0)


def _rows(a):
    """``a`` itself when its rows are contiguous (any row and batch stride), else a copy."""
    return a if a.strides[2] == a.itemsize and a.strides[1] >= a.shape[2] * a.itemsize \
        and a.strides[1] % a.itemsize == 0 and a.strides[0] % a.itemsize == 0 else xp.ascontiguousarray(a)


def gemm(a, b, out, ta=False, tb=False, beta=0.0):
    """out = op(a) op(b) + beta out, batched, as ONE cublasGemmStridedBatchedEx: op(a) (batch, M, K)
    is ``a`` or, with ``ta``, the transpose of ``a`` (batch, K, M); likewise ``b``; out (batch, M, N).
    Every operand only needs contiguous rows (slices of rows or columns of a larger array are
    passed by their leading dimension, a transpose by the op flag: no copies). Row-major
    C = A B is column-major C^T = B^T A^T, so cuBLAS gets (b, a) and m = N, n = M.
    Compute type: 64F for float64; float32: 32F_FAST_TF32 when ``allow_tf32``, else 32F;
    bf16/fp16 operands: 32F (tensor cores, fp32 accumulate; ``out`` may be float32)."""
    from cupy.cuda import cublas, device, runtime
    a, b = _rows(a), _rows(b)
    pa, lda, sa = _operand(a)
    pb, ldb, sb = _operand(b)
    pc, ldc, sc = _operand(out)
    batch, M, N = out.shape
    K = a.shape[1] if ta else a.shape[2]
    if out.dtype == xp.float64:
        compute, scal = cublas.CUBLAS_COMPUTE_64F, xp.float64
    else:
        fast = out.dtype == xp.float32 and a.dtype == xp.float32 and _TF32[0]
        compute, scal = (cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if fast else cublas.CUBLAS_COMPUTE_32F), xp.float32
    import numpy
    alpha, beta_h = numpy.array(1, scal), numpy.array(beta, scal)   # host scalars (host pointer mode)
    kind = lambda x: getattr(runtime, _CUDA_TYPES[x.dtype.name][0], _CUDA_TYPES[x.dtype.name][1])  # noqa: E731
    opt = lambda t: cublas.CUBLAS_OP_T if t else cublas.CUBLAS_OP_N  # noqa: E731
    cublas.gemmStridedBatchedEx(device.get_cublas_handle(), opt(tb), opt(ta), N, M, K, alpha.ctypes.data,
                                pb, kind(b), ldb, sb, pa, kind(a), lda, sa, beta_h.ctypes.data,
                                pc, kind(out), ldc, sc, batch, compute, cublas.CUBLAS_GEMM_DEFAULT)
    return out


def low_matmul(a, b, low):
    """``a @ b`` (2-D) as ONE GEMM on bf16/fp16 tensor cores (``low``: the 2-byte dtype), fp32
    accumulate, the result float32 and unrounded. Both operands are rounded to ``low`` first
    (exact for mixed precision's rounded inputs and weights; a gradient G loses its low bits,
    as under autocast). Transposed views pass as op flags, not copies."""
    a2, b2 = a.astype(low, copy=False), b.astype(low, copy=False)
    ta, tb = (not x.flags.c_contiguous and x.T.flags.c_contiguous for x in (a2, b2))
    out = xp.empty((1, a2.shape[0], b2.shape[1]), dtype=xp.float32)
    return gemm((a2.T if ta else a2)[None], (b2.T if tb else b2)[None], out, ta=ta, tb=tb)[0]


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
        s = xp.empty((B * n_kv, m * g, hi), dtype=Q.dtype)
        gemm(Q[:, lo * g:hi * g], K[:, :hi], s, tb=True)  # S = Q K^T, (B n_kv, m g, hi)
        s *= scale
        s4 = s.reshape(B * n_kv, m, g, hi)
        s4[..., lo:hi] += causal_mask(m, m, s.dtype)[:, None, :]  # the diagonal tile, every head
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        yb = gemm(s, V[:, :hi], xp.empty((B * n_kv, m * g, hs), dtype=Q.dtype))  # (B n_kv, m g, hs)
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
        first = 0.0 if hi == T else 1.0  # the last block (every key) writes dV, dK; the others add
        gemm(p, gb, dV[:, :hi], ta=True, beta=first)  # dV += P^T G
        dp = gemm(gb, V[:, :hi], xp.empty_like(p), tb=True)  # dP = G V^T, (B n_kv, m g, hi)
        dp -= (dp * p).sum(axis=-1, keepdims=True)
        dp *= p  # dS
        gemm(dp, K[:, :hi], dQ[:, rows])  # dQ = dS K
        gemm(dp, Q[:, rows], dK[:, :hi], ta=True, beta=first)  # dK += dS^T Q
    dQ *= scale
    dK *= scale
    gq5[...] = dQ.reshape(B, n_kv, T, g, hs).transpose(0, 1, 3, 2, 4)
    gk4[...] = dK.reshape(B, n_kv, T, hs)
    gv4[...] = dV.reshape(B, n_kv, T, hs)


__all__ = ["DEVICE_QBLOCK", "allow_tf32", "gemm", "low_matmul", "forward", "backward", "blocks"]
