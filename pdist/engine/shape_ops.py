"""Differentiable shapes and indexing: reshape, permute / transpose, getitem,
concat and split. Each is a ``Function`` whose backward puts the gradient back
in the input's shape: reshape back, the inverse permutation, a scatter (added
for repeated indices), the slices of a concat. ``pdist.engine.ops`` attaches
them to ``Tensor`` (``x.reshape``, ``x.T``, ``x[i]``, ``x.split``).
"""
import builtins

from pdist.engine.autograd import Function, Tensor
from pdist.engine.backend import scatter_add, xp


class Reshape(Function):
    param_view = True     # a reshaped weight is a weight (split backward, backprop.py)

    def forward(self, a, shape):
        self.shape = a.shape
        return a.reshape(shape)

    def backward(self, g):
        return g.reshape(self.shape)


class Permute(Function):
    """y = a.transpose(axes) (a view); dA = g.transpose(inverse permutation)."""
    param_view = True
    def forward(self, a, axes):
        inv = [0] * len(axes)
        for i, ax in enumerate(axes):
            inv[ax] = i
        self.inv = tuple(inv)  # plain Python: no device round trip on a GPU
        return a.transpose(axes)

    def backward(self, g):
        return g.transpose(self.inv)


class GetItem(Function):
    """y = a[index]; da = zeros with g scattered (added, for repeated indices) at index."""
    def forward(self, a, index):
        self.shape, self.dtype, self.index = a.shape, a.dtype, index
        return a[index]

    def backward(self, g):
        out = xp.zeros(self.shape, dtype=self.dtype)
        idx = self.index if isinstance(self.index, tuple) else (self.index,)
        if any(hasattr(i, "shape") or isinstance(i, list) for i in idx):
            scatter_add(out, self.index, g)
        else:
            out[self.index] = g
        return out


class Concat(Function):
    def forward(self, *arrays, axis=0):
        self.axis = axis
        self.bounds = [0]
        for a in arrays:
            self.bounds.append(self.bounds[-1] + a.shape[axis])
        return xp.concatenate(arrays, axis=axis)

    def backward(self, g):
        ax = self.axis % g.ndim
        sl = [slice(None)] * g.ndim
        out = []
        for lo, hi in zip(self.bounds[:-1], self.bounds[1:]):
            sl[ax] = slice(lo, hi)
            out.append(g[tuple(sl)])
        return tuple(out)


def reshape(a, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return Reshape.apply(a, shape=shape)


def permute(a, *axes):
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    nd = a.ndim
    axes = tuple(i % nd for i in axes)
    if sorted(axes) != list(range(nd)):
        raise ValueError(f"permute: {axes} is not a permutation of the {nd} axes")
    return Permute.apply(a, axes=axes)


def transpose(a, dim0=-2, dim1=-1):
    """Swap two axes (PyTorch's transpose)."""
    axes = list(range(a.ndim))
    axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
    return Permute.apply(a, axes=tuple(axes))


def concat(tensors, axis=0):
    return Concat.apply(*tensors, axis=axis)


def split(a, sections, axis=0):
    """Split into pieces of the given sizes (a list) or into n equal pieces (an int)."""
    n = a.shape[axis]
    if isinstance(sections, int):
        if n % sections:
            raise ValueError(f"split: axis {axis} of size {n} does not divide into {sections} equal parts")
        sections = [n // sections] * sections
    if builtins.sum(sections) != n:
        raise ValueError(f"split: sizes {sections} do not add up to {n}")
    out, lo = [], 0
    for s in sections:
        idx = [slice(None)] * a.ndim
        idx[axis] = slice(lo, lo + s)
        out.append(a[tuple(idx)])
        lo += s
    return out


def _getitem(a, index):
    if isinstance(index, Tensor):
        index = index.data
    if isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return GetItem.apply(a, index)
