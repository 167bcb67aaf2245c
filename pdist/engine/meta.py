"""Meta parameters: a model's shapes without its values (PyTorch's ``device="meta"``),
filled later piece by piece, so that no rank ever holds the whole model.

    model = ZeRO(GPT(cfg, seed, device="meta"), stage=3, group=dp)   # each rank: its shard only

``GPT(cfg, seed, device="meta")`` builds the modules with ``MetaArray`` data: a shape
and a dtype, no memory. A strategy then *materializes* what this rank holds, the way
FSDP materializes a meta-device model: for every piece (``pdist.parallel.layout``: which
box of which single-process tensor sits where on this rank) it draws the tensor's values
in row chunks, keeps the rows of the box, writes them in place and drops the chunk:

    for rows [a, b) of the global tensor, in chunks of ~CHUNK_ELEMS elements:
        chunk = init(name, a, b)                     # float64, the same stream as gpt_init
        piece.view(data)[a - o : b - o] = chunk[box's other axes]

So the values are ``gpt_init``'s to the bit (the generator is consumed in the same order,
chunked: ``tests/test_meta_init.py`` checks it) and the memory a rank touches while
initializing is its pieces plus one chunk. Any computation on a MetaArray raises: a meta
model must be materialized first (``parallelize`` and ``ZeRO`` do it; alone,
``TensorParallel``/``PipelineParallel`` call ``model.materialize()``).
"""
import math

import numpy as np

from pdist.engine.backend import xp

CHUNK_ELEMS = 1 << 16   # float64 elements drawn at a time (512 KiB)


class MetaArray:
    """A shape and a dtype, no values (``nbytes`` is 0: it holds no memory; no ``base``)."""

    nbytes, base = 0, None

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)

    size = property(lambda self: math.prod(self.shape))
    ndim = property(lambda self: len(self.shape))

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return MetaArray(_reshaped(self, shape), self.dtype)

    def copy(self):
        return MetaArray(self.shape, self.dtype)

    def astype(self, dtype, **kw):
        return MetaArray(self.shape, dtype)

    def __array__(self, *a, **kw):
        raise TypeError("a meta parameter has no values: materialize the model first "
                        "(parallelize/ZeRO do it; or model.materialize())")

    def __getattr__(self, name):
        raise TypeError(f"a meta parameter has no values (.{name}): materialize the model first "
                        "(parallelize/ZeRO do it; or model.materialize())")

    def _no_values(self, *a, **kw):
        raise TypeError("a meta parameter has no values: materialize the model first "
                        "(parallelize/ZeRO do it; or model.materialize())")

    __getitem__ = __setitem__ = __iter__ = __len__ = __float__ = __bool__ = _no_values
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _no_values
    __matmul__ = __rmatmul__ = __neg__ = __pow__ = __iadd__ = __imul__ = _no_values

    def __repr__(self):
        return f"MetaArray(shape={self.shape}, dtype={self.dtype})"


def _reshaped(a, shape):
    shape = list(shape)
    if shape.count(-1) == 1:
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = a.size // max(known, 1)
    if math.prod(shape) != a.size:
        raise ValueError(f"cannot reshape a meta array of size {a.size} into shape {tuple(shape)}")
    return tuple(shape)


class RowStream:
    """Rows [a, b) of a tensor of ``shape`` whose values are drawn row-major from one generator:
    ``draw(n)`` -> the next n rows, float64. Calls in increasing row order continue the
    stream; an earlier row restarts it (``restart()`` -> a fresh ``draw``)."""

    def __init__(self, shape, restart):
        self.shape, self.restart = tuple(shape) or (1,), restart
        self.draw, self.next_row = restart(), 0

    def rows(self, a, b):
        if a < self.next_row:
            self.draw, self.next_row = self.restart(), 0
        inner = math.prod(self.shape[1:])
        step = max(1, CHUNK_ELEMS // max(1, inner))
        while self.next_row < a:                          # skip: draw and drop
            k = min(step, a - self.next_row)
            self.draw(k)
            self.next_row += k
        self.next_row = b
        return self.draw(b - a)


def is_meta(a):
    return isinstance(a, MetaArray)


def zeros_view(a):
    """Zeros of ``a``'s shape and dtype that take no memory (a read-only broadcast view):
    code that slices a "master" array (tensor parallelism) copies only its slice."""
    return np.broadcast_to(np.zeros((), a.dtype), a.shape)


def fill_pieces(pieces, init_rows):
    """Write every piece's values in place: ``piece.view(piece.tensor.data)`` gets rows
    [o, o + n) of its global tensor, drawn by ``init_rows(name, a, b)`` -> float64 rows
    [a, b) (``pdist.models.gpt.GPT.init_rows``), CHUNK_ELEMS elements at a time."""
    for pc in pieces:
        dst = pc.view(pc.tensor.data)                      # the piece's place on this rank
        # a low-precision parameter (pdist.engine.precision.cast_module) is rounded the way its
        # full-precision init would be: float64 -> its compute dtype -> the low dtype
        via = getattr(pc.tensor, "compute_dtype", None) or dst.dtype
        if dst.ndim == 0:
            dst[...] = xp.asarray(init_rows(pc.name, 0, 1).reshape(()), dtype=via)
            continue
        o0, n0 = pc.offsets[0], pc.shape[0]
        rest = tuple(slice(o, o + n) for o, n in zip(pc.offsets[1:], pc.shape[1:]))
        step = max(1, CHUNK_ELEMS // max(1, math.prod(pc.global_shape[1:])))
        for a in range(o0, o0 + n0, step):
            b = min(a + step, o0 + n0)
            dst[a - o0:b - o0] = xp.asarray(init_rows(pc.name, a, b)[(slice(None),) + rest], dtype=via)


def materialize(pieces, init_rows):
    """Give every tensor of ``pieces`` whose data is meta zeros of its shape (padding stays
    0), then fill its pieces. Tensors already holding values are left alone."""
    todo = [pc for pc in pieces if is_meta(pc.tensor.data)]
    for t in {id(pc.tensor): pc.tensor for pc in todo}.values():
        t.data = xp.zeros(t.data.shape, dtype=t.data.dtype)
    fill_pieces(todo, init_rows)


class _Whole:
    """A whole tensor as a piece (the subset of layout.Piece that fill_pieces reads)."""

    def __init__(self, name, tensor):
        self.name, self.tensor = name, tensor
        self.global_shape = self.shape = tuple(tensor.data.shape)
        self.offsets = (0,) * len(self.shape)

    def view(self, a):
        return a


def materialize_whole(named_params, init_rows):
    """One process: every meta parameter in ``named_params`` [(name, Parameter)] gets its
    whole value."""
    materialize([_Whole(n, p) for n, p in named_params], init_rows)
