"""Differentiable array operations: elementwise (with broadcasting), matmul and
reductions, and the operators and methods of ``Tensor``. Each is a ``Function``
with its derivative; shapes and indexing (reshape, permute, getitem, concat,
split) are in ``pdist.engine.shape_ops``, the fused neural-network ops (softmax,
GELU, LayerNorm, cross-entropy, ...) in ``pdist.engine.functional``.

Broadcasting rule for gradients: if ``x`` of shape ``s`` was broadcast to the
output's shape, ``dL/dx`` is ``dL/dy`` summed over the broadcast axes
(``unbroadcast``).
"""
from pdist.engine.autograd import Function, Tensor
from pdist.engine.backend import xp
from pdist.engine.shape_ops import _getitem, permute, reshape, split, transpose


def unbroadcast(g, shape):
    """Sum g (shape of the broadcast result) down to ``shape``."""
    if g.shape == shape:
        return g
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g


def _shape(x):
    return x.shape if hasattr(x, "shape") else ()


# --- elementwise -------------------------------------------------------------
class Add(Function):
    """y = a + b"""
    def forward(self, a, b):
        self.sa, self.sb = _shape(a), _shape(b)
        return a + b

    def backward(self, g):
        return unbroadcast(g, self.sa), unbroadcast(g, self.sb)


class Sub(Function):
    """y = a - b"""
    def forward(self, a, b):
        self.sa, self.sb = _shape(a), _shape(b)
        return a - b

    def backward(self, g):
        return unbroadcast(g, self.sa), unbroadcast(-g, self.sb)


class Mul(Function):
    """y = a * b;  da = g b, db = g a"""
    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, g):
        na, nb = self.needs_input_grad
        ga = unbroadcast(g * self.b, _shape(self.a)) if na else None
        gb = unbroadcast(g * self.a, _shape(self.b)) if nb else None
        return ga, gb


class Div(Function):
    """y = a / b;  da = g / b, db = -g a / b^2"""
    def forward(self, a, b):
        self.a, self.b = a, b
        return a / b

    def backward(self, g):
        na, nb = self.needs_input_grad
        ga = unbroadcast(g / self.b, _shape(self.a)) if na else None
        gb = unbroadcast(-g * self.a / (self.b * self.b), _shape(self.b)) if nb else None
        return ga, gb


class Neg(Function):
    def forward(self, a):
        return -a

    def backward(self, g):
        return -g


class Pow(Function):
    """y = a^p for a constant exponent p;  da = g p a^(p-1)"""
    def forward(self, a, p):
        self.a, self.p = a, p
        return a ** p

    def backward(self, g):
        return g * self.p * self.a ** (self.p - 1), None


class Exp(Function):
    def forward(self, a):
        self.y = xp.exp(a)
        return self.y

    def backward(self, g):
        return g * self.y


class Log(Function):
    def forward(self, a):
        self.a = a
        return xp.log(a)

    def backward(self, g):
        return g / self.a


class Tanh(Function):
    def forward(self, a):
        self.y = xp.tanh(a)
        return self.y

    def backward(self, g):
        return g * (1 - self.y * self.y)


class ReLU(Function):
    def forward(self, a):
        self.mask = a > 0
        return a * self.mask

    def backward(self, g):
        return g * self.mask


# --- matmul --------------------------------------------------------------------
class MatMul(Function):
    """Y = A @ B (batched, broadcasting leading axes);
    dA = G @ B^T, dB = A^T @ G (summed over broadcast axes).

    Reads A and B from its parents at backward time (see autograd's contract), or, where a
    split backward dropped a parent between B and W, from forward's arrays."""
    split_backward = True

    def forward(self, a, b):
        if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not match: the last axis of "
                             f"the first ({a.shape[-1] if a.ndim else '-'}) must equal the "
                             f"{'second-to-last' if b.ndim > 1 else 'only'} axis of the second")
        if b.ndim < 2 or a.ndim < 1:
            raise ValueError("matmul: both operands need at least 2 dims in pdist (reshape vectors)")
        self.a, self.b = a, b
        return a @ b

    def backward(self, g):
        pa, pb = self.parents
        a = pa.data if pa is not None else self.a
        b = pb.data if pb is not None else self.b
        na, nb = self.needs_input_grad
        ga = gb = None
        if na:
            ga = unbroadcast(g @ xp.swapaxes(b, -1, -2), a.shape)
        if nb:
            if b.ndim == 2 and a.ndim > 2:  # (..., K) x (K, N): one big GEMM
                gb = a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            else:
                gb = unbroadcast(xp.swapaxes(a, -1, -2) @ g, b.shape)
        return ga, gb


# --- reductions -----------------------------------------------------------------
def _norm_axis(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(a % ndim for a in axis)


class Sum(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axis, self.keep = a.shape, _norm_axis(axis, a.ndim), keepdims
        return a.sum(axis=self.axis, keepdims=keepdims)

    def backward(self, g):
        if not self.keep:
            g = xp.expand_dims(g, self.axis)
        return xp.broadcast_to(g, self.shape)


class Mean(Function):
    def forward(self, a, axis=None, keepdims=False):
        self.shape, self.axis, self.keep = a.shape, _norm_axis(axis, a.ndim), keepdims
        self.n = 1
        for i in self.axis:
            self.n *= a.shape[i]
        return a.mean(axis=self.axis, keepdims=keepdims)

    def backward(self, g):
        if not self.keep:
            g = xp.expand_dims(g, self.axis)
        return xp.broadcast_to(g / self.n, self.shape)


class Max(Function):
    """y = max over axis; the gradient is split evenly among tied maxima."""
    def forward(self, a, axis=None, keepdims=False):
        self.axis, self.keep = _norm_axis(axis, a.ndim), keepdims
        y = a.max(axis=self.axis, keepdims=True)
        self.mask = a == y
        return y if keepdims else y.squeeze(self.axis)

    def backward(self, g):
        if not self.keep:
            g = xp.expand_dims(g, self.axis)
        return self.mask * (g / self.mask.sum(axis=self.axis, keepdims=True))


# --- the functional API ----------------------------------------------------------------
def add(a, b): return Add.apply(a, b)
def sub(a, b): return Sub.apply(a, b)
def mul(a, b): return Mul.apply(a, b)
def div(a, b): return Div.apply(a, b)
def neg(a): return Neg.apply(a)
def exp(a): return Exp.apply(a)
def log(a): return Log.apply(a)
def tanh(a): return Tanh.apply(a)
def relu(a): return ReLU.apply(a)
def matmul(a, b): return MatMul.apply(a, b)


def pow(a, p):
    if isinstance(p, Tensor):
        raise TypeError("pow: the exponent must be a number (use exp(p * log(a)) for tensor exponents)")
    return Pow.apply(a, p)


def sum(a, axis=None, keepdims=False): return Sum.apply(a, axis=axis, keepdims=keepdims)  # noqa: A001
def mean(a, axis=None, keepdims=False): return Mean.apply(a, axis=axis, keepdims=keepdims)
def max(a, axis=None, keepdims=False): return Max.apply(a, axis=axis, keepdims=keepdims)  # noqa: A001


def _rev(fn):
    return lambda self, other: fn(other, self)


# Tensor's operators and array methods are registered here, on import (pdist/__init__
# imports this module), so that pdist.engine.autograd does not import pdist.engine.ops (no cycle).
Tensor.__add__ = add
Tensor.__radd__ = _rev(add)
Tensor.__sub__ = sub
Tensor.__rsub__ = _rev(sub)
Tensor.__mul__ = mul
Tensor.__rmul__ = _rev(mul)
Tensor.__truediv__ = div
Tensor.__rtruediv__ = _rev(div)
Tensor.__neg__ = neg
Tensor.__pow__ = pow
Tensor.__matmul__ = matmul
Tensor.__rmatmul__ = _rev(matmul)
Tensor.__getitem__ = _getitem
Tensor.exp = exp
Tensor.log = log
Tensor.tanh = tanh
Tensor.relu = relu
Tensor.sum = sum
Tensor.mean = mean
Tensor.max = max
Tensor.reshape = reshape
Tensor.view = reshape
Tensor.permute = permute
Tensor.transpose = transpose
Tensor.T = property(lambda self: transpose(self, -2, -1))
Tensor.split = split
