"""cupy.cuda.cublas stand-in: ``gemmStridedBatchedEx`` with cuBLAS's contract, over the raw
pointers of device arrays (column-major operands, leading dimensions, batch strides, op
flags, host-pointer alpha/beta), so a wrong argument reads or writes the wrong elements as it
would on a GPU. Compute types: 64F in float64, 32F in float32, 32F_FAST_TF32 rounds both
inputs to TF32 (10-bit mantissa) first, as the tensor cores do. Constants: CuPy 14's values."""
import ctypes

import numpy as _np
from numpy.lib.stride_tricks import as_strided

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
CUBLAS_GEMM_DEFAULT = -1
calls = [0]            # gemmStridedBatchedEx calls (tests count them)
compute_types = []     # the compute type of every call, in order


def _dtype(code):
    if code == 14:
        import ml_dtypes
        return _np.dtype(ml_dtypes.bfloat16)
    return {0: _np.dtype(_np.float32), 1: _np.dtype(_np.float64), 2: _np.dtype(_np.float16)}[code]


def _matrix(ptr, code, rows, cols, ld, stride, batch):
    """The (batch, rows, cols) column-major matrices at ``ptr`` as a writable NumPy view."""
    dt = _dtype(code)
    if ld < max(1, rows):
        raise ValueError(f"cublas stand-in: ld {ld} < rows {rows} (CUBLAS_STATUS_INVALID_VALUE)")
    n = (batch - 1) * stride + (cols - 1) * ld + rows if rows and cols and batch else 0
    buf = (ctypes.c_char * (n * dt.itemsize)).from_address(ptr) if n else bytearray(0)
    base = _np.frombuffer(buf, dtype=dt)
    s = dt.itemsize
    return as_strided(base, (batch, rows, cols), (stride * s, s, ld * s))


def _tf32(a):
    """Round float32 values to TF32 (8-bit exponent, 10-bit mantissa), to nearest even."""
    u = _np.ascontiguousarray(a, _np.float32).view(_np.uint32)
    u = (u + 0x0FFF + ((u >> 13) & 1)) & _np.uint32(0xFFFFE000)
    return u.view(_np.float32)


def gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                         strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
    calls[0] += 1
    compute_types.append(computeType)
    acc = _np.float64 if computeType == CUBLAS_COMPUTE_64F else _np.float32
    al = _np.frombuffer((ctypes.c_char * 8).from_address(alpha), dtype=acc, count=1)[0]
    be = _np.frombuffer((ctypes.c_char * 8).from_address(beta), dtype=acc, count=1)[0]
    a = _matrix(A, Atype, *((m, k) if transa == CUBLAS_OP_N else (k, m)), lda, strideA, batchCount)
    b = _matrix(B, Btype, *((k, n) if transb == CUBLAS_OP_N else (n, k)), ldb, strideB, batchCount)
    c = _matrix(C, Ctype, m, n, ldc, strideC, batchCount)
    a = a if transa == CUBLAS_OP_N else a.transpose(0, 2, 1)
    b = b if transb == CUBLAS_OP_N else b.transpose(0, 2, 1)
    a, b = a.astype(acc), b.astype(acc)
    if computeType == CUBLAS_COMPUTE_32F_FAST_TF32:
        a, b = _tf32(a), _tf32(b)
    r = al * _np.matmul(a, b)
    if be != 0:
        r = r + be * c.astype(acc)
    c[...] = r.astype(c.dtype)
    return 0
