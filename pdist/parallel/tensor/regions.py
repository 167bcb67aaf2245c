"""Megatron's conjugate communication regions as autograd Functions (Shoeybi et al. 2019,
section 3; sequence-parallel ones: Korthikanti et al. 2022, section 4.2.2), and the
partitioning helpers every tensor-parallel layout uses. Read through
``pdist.parallel.tensor.tensor_parallel``, which re-exports the public names.

    region                                            forward               backward
    copy_to_tensor_parallel_region              (f)   identity              all-reduce
    reduce_from_tensor_parallel_region          (g)   all-reduce            identity
    scatter_to_tensor_parallel_region                 own last-axis chunk   all-gather
    gather_from_tensor_parallel_region                all-gather last axis  own chunk
    scatter_to_sequence_parallel_region               own T/t tokens        all-gather
    gather_from_sequence_parallel_region    (SP f)    all-gather sequence   reduce-scatter
    reduce_scatter_to_sequence_parallel_region (SP g) reduce-scatter        all-gather

Each pair is conjugate: the backward of one is the forward of the other, so a column
block (f ... g) is differentiated exactly. Activations are (B, T, C); the sequence axis
is 1. With a group of one rank every region is the identity (Megatron does the same).
Buffers are copied before reducing in place: a gradient array can be shared by two
branches of the graph (Add's backward hands the same array to both inputs).
``SharedInput``: one f (SP: one all-gather) for the column layers of a block that read the
same input (Megatron's fused [Q | K | V] and [gate | up] GEMMs).
"""
import weakref

from pdist.engine.autograd import Function
from pdist.engine.backend import xp
from pdist.parallel.layout import Cut

SEQ_AXIS = 1  # activations are (B, T, C)


# --- partitioning (host or device arrays) ---------------------------------------------------
def divide(n, t, what, fix=""):
    """n / t, or a ValueError that says what does not divide and how to fix it."""
    if n % t:
        fix = fix or f"Choose {what} as a multiple of {t}, or a tp size that divides it."
        raise ValueError(f"tensor parallelism: {what} = {n} is not divisible by the tensor-parallel "
                         f"size {t}. {fix}")
    return n // t


def partition(a, axis, rank, n, stride=1):
    """Rank's block of ``a`` along ``axis``: ``Cut(axis, rank, n, stride).take(a)`` (the one
    cut, pdist/parallel/layout.py). The axis is cut into ``stride`` equal parts (3 for
    GPT-2's fused [Q | K | V] columns), each part into n chunks; the rank keeps chunk
    ``rank`` of every part, in order. stride=1: a contiguous 1/n slice."""
    axis %= a.ndim
    divide(a.shape[axis], n * stride, f"axis {axis} of a {tuple(a.shape)} array (/{stride} parts)")
    return Cut(axis, rank, n, stride).take(a)


def _copy(a):
    return xp.array(a, copy=True, order="C")  # never reduce into a gradient someone else holds


def _all_reduce(a, group, op="sum"):
    buf = _copy(a)
    group.all_reduce(buf, op=op)
    return buf


def _all_gather(x, axis, group):
    """(..., d, ...) on each rank -> (..., t d, ...): rank q's block at [q d, (q+1) d)."""
    t, axis = group.size, axis % x.ndim
    out = xp.empty((t,) + x.shape, dtype=x.dtype)  # (t, ..., d, ...)
    group.all_gather(out, xp.ascontiguousarray(x))
    out = xp.moveaxis(out, 0, axis)  # (..., t, d, ...)
    return out.reshape(x.shape[:axis] + (t * x.shape[axis],) + x.shape[axis + 1:])


def _reduce_scatter(x, axis, group):
    """(..., t d, ...) partial sums on each rank -> this rank's (..., d, ...) block of the sum."""
    t, axis = group.size, axis % x.ndim
    d = divide(x.shape[axis], t, f"the size of axis {axis} to reduce-scatter")
    parts = x.reshape(x.shape[:axis] + (t, d) + x.shape[axis + 1:])
    inp = xp.ascontiguousarray(xp.moveaxis(parts, axis, 0))  # (t, ..., d, ...)
    out = xp.empty(inp.shape[1:], dtype=x.dtype)
    group.reduce_scatter(out, inp)
    return out


def _split(x, axis, group):
    return xp.ascontiguousarray(partition(x, axis, group.rank, group.size))


# --- the conjugate regions --------------------------------------------------------------------
class _CopyToTP(Function):
    """f: forward identity, backward all-reduce (dX = sum_i dX_i over the column shards)."""
    def forward(self, x, group):
        self.group = group
        return x

    def backward(self, g):
        return _all_reduce(g, self.group)


class _ReduceFromTP(Function):
    """g: forward all-reduce (Y = sum_i Y_i), backward identity."""
    def forward(self, x, group):
        return _all_reduce(x, group)

    def backward(self, g):
        return g


class _ScatterToTP(Function):
    """forward keeps this rank's chunk of the last axis, backward all-gathers it."""
    def forward(self, x, group):
        self.group = group
        return _split(x, -1, group)

    def backward(self, g):
        return _all_gather(g, -1, self.group)


class _GatherFromTP(Function):
    """forward all-gathers the last axis, backward keeps this rank's chunk."""
    def forward(self, x, group):
        self.group = group
        return _all_gather(x, -1, group)

    def backward(self, g):
        return _split(g, -1, self.group)


class _ScatterToSP(Function):
    """forward keeps this rank's T/t tokens, backward all-gathers the sequence."""
    def forward(self, x, group):
        self.group = group
        return _split(x, SEQ_AXIS, group)

    def backward(self, g):
        return _all_gather(g, SEQ_AXIS, self.group)


class _GatherFromSP(Function):
    """forward all-gathers the sequence (B, T/t, C) -> (B, T, C); backward reduce-scatters:
    the consumer is column-parallel, so each rank's dX is a partial sum over its columns."""
    def forward(self, x, group):
        self.group = group
        return _all_gather(x, SEQ_AXIS, group)

    def backward(self, g):
        return _reduce_scatter(g, SEQ_AXIS, self.group)


class _ReduceScatterToSP(Function):
    """forward reduce-scatters partial sums (B, T, C) -> (B, T/t, C); backward all-gathers."""
    def forward(self, x, group):
        self.group = group
        return _reduce_scatter(x, SEQ_AXIS, group)

    def backward(self, g):
        return _all_gather(g, SEQ_AXIS, self.group)


def _region(fn):
    def apply(x, group):
        return x if group.size == 1 else fn.apply(x, group=group)
    apply.__name__, apply.__doc__ = fn.__name__, fn.__doc__
    return apply


copy_to_tensor_parallel_region = _region(_CopyToTP)
reduce_from_tensor_parallel_region = _region(_ReduceFromTP)
scatter_to_tensor_parallel_region = _region(_ScatterToTP)
gather_from_tensor_parallel_region = _region(_GatherFromTP)
scatter_to_sequence_parallel_region = _region(_ScatterToSP)
gather_from_sequence_parallel_region = _region(_GatherFromSP)
reduce_scatter_to_sequence_parallel_region = _region(_ReduceScatterToSP)


class SharedInput:
    """One f region (SP: one all-gather) for the column-parallel layers of a block that read
    the same input, as Megatron's fused [Q | K | V] and [gate | up] GEMMs share theirs: the
    first layer to see an input applies the region, the others reuse its output, so backward
    sums their dX and all-reduces (SP: reduce-scatters) once. Holds weak references only.
    ``join()`` gives each reading layer its place among the readers, in the plan's order."""

    def __init__(self, group, sequence_parallel):
        self.group, self.sequence_parallel, self._x, self._y = group, sequence_parallel, None, None
        self.consumers = 0

    def join(self):
        self.consumers += 1
        return self.consumers - 1

    def __call__(self, x, consumer=0):
        if self._x is None or self._x() is not x or self._y() is None:
            y = (gather_from_sequence_parallel_region if self.sequence_parallel
                 else copy_to_tensor_parallel_region)(x, self.group)
            self._x, self._y = weakref.ref(x), weakref.ref(y)
            return y
        return self._y()


__all__ = ["SharedInput", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "partition", "divide", "SEQ_AXIS"]
