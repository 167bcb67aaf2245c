"""cupyx stand-in: scatter_add, empty_pinned, zeros_pinned (tests only)."""
import numpy as _np

import cupy as _cp


def scatter_add(a, index, values):
    _np.add.at(a._a, _cp._index_as_cupy(a._a.shape, index), _cp._unwrap(values, "scatter_add values"))


pinned_allocs = [0]      # host buffers made by empty_pinned / zeros_pinned (page-locked on a GPU)


def empty_pinned(shape, dtype=float, order="C"):
    """A NumPy array (on a GPU: in page-locked memory, so copies to and from it can be async)."""
    pinned_allocs[0] += 1
    return _np.empty(shape, dtype, order)


def zeros_pinned(shape, dtype=float, order="C"):
    pinned_allocs[0] += 1
    return _np.zeros(shape, dtype, order)
