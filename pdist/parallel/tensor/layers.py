"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022), built as autograd Functions over a tensor-parallel
ProcessGroup of t ranks.

    Column parallel:  Y = X A + b,  A = [A_1 ... A_t] split by columns,  rank i: Y_i = X A_i + b_i
    Row parallel:     Y = X A + b,  A = [A_1; ...; A_t] split by rows, X = [X_1 ... X_t],
                      Y = sum_i X_i A_i + b          (one all-reduce, then the bias once)

An MLP is column then row: GeLU(X A) B = sum_i GeLU(X A_i) B_i, so each rank runs
its slice with no communication in between; attention is split the same way, by
heads. Two conjugate regions close each block (Megatron's f and g; all seven regions,
with the sequence-parallel ones, are in regions.py and re-exported here):

    f = copy_to_tensor_parallel_region       forward identity     backward all-reduce
    g = reduce_from_tensor_parallel_region   forward all-reduce   backward identity

Sequence parallelism replaces g by a reduce-scatter along the sequence and f by an
all-gather: the same bytes ((t-1)/t S each; the pair moves 2(t-1)/t S, one all-reduce),
but LayerNorm, dropout and the residual stream hold only T/t tokens per rank.
Activations are (B, T, C). VocabParallelEmbedding and vocab_parallel_cross_entropy
split the vocabulary so that no rank ever holds the full logits.

``TensorParallel`` (tensor_parallel.py) swaps the one GPT's layers for these.
"""
import numpy as np

from pdist import nn
from pdist.engine import precision
from pdist.engine.autograd import Function, Tensor
from pdist.engine.backend import asarray, default_dtype, xp
from pdist.engine.functional import embedding_grad
from pdist.engine.index_checks import check_indices
from pdist.comm import default_group
from pdist.parallel.layout import Cut
from pdist.parallel.tensor.regions import (  # noqa: F401  (re-exported: the public API)
    SEQ_AXIS, SharedInput, copy_to_tensor_parallel_region, divide, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, partition, reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region)


# --- layers ---------------------------------------------------------------------------------------
def _master(shape, given, draw, rng):
    """The full (master) array: the one given, else drawn from rng the way nn.Linear draws it,
    so the layout never changes the initial weights (docs/design.md)."""
    if given is not None:
        if tuple(np.shape(given)) != tuple(shape):
            raise ValueError(f"master weight has shape {tuple(np.shape(given))}, expected {tuple(shape)}")
        return given
    return draw(rng, shape)


def _uniform(fan_in):
    k = 1.0 / np.sqrt(fan_in)
    return lambda rng, shape: rng.uniform(-k, k, shape)


def _shard(full, cut, dtype):
    """This rank's Parameter of the full host array ``full``, recording its ``cut`` and the full
    shape on the parameter (Megatron's partition_dim): ``pieces()`` reads them (layout.py)."""
    p = nn.Parameter(asarray(cut.take(np.asarray(full)) if cut is not None else np.asarray(full), dtype=dtype))
    p.global_shape = tuple(np.shape(full))
    if cut is not None:
        p.cut = cut
    return p


def _linear(x, w, b, layout):
    """y = x W + b (W stored (in, out)) or x W^T + b (W stored (out, in))."""
    return precision.linear(x, w if layout == "in_out" else w.T, b)


def _check_layout(layout):
    if layout not in ("in_out", "out_in"):
        raise ValueError(f"layout must be 'in_out' (W stored (in, out)) or 'out_in' (W stored (out, in)), "
                         f"got {layout!r}")
    return layout


class ColumnParallelLinear(nn.Module):
    """Y = X A + b, A (in, out) split by columns: rank i holds A_i (in, out/t) and b_i and
    computes Y_i = X A_i + b_i (Megatron-LM, Shoeybi et al. 2019, section 3).

    The input enters through f (identity; backward all-reduces dX = sum_i dY_i A_i^T), or
    with ``sequence_parallel`` as sequence shards (B, T/t, in) that are all-gathered
    (backward: reduce-scatter; Korthikanti et al. 2022). ``gather_output`` all-gathers
    Y = [Y_1 ... Y_t]; otherwise the output stays (..., out/t) for a RowParallelLinear.
    ``stride`` > 1 splits each of ``stride`` column groups separately (fused [Q|K|V]).
    ``layout="out_in"`` stores A^T (out, in) as PyTorch does (the cut is then on axis 0).
    ``weight``: an existing Parameter holding this rank's (out/t, in) or (in, out/t) shard
    to share (a head tied to a vocab-parallel embedding); no master weight is drawn then.
    ``shared_input``: a SharedInput that several column layers of one block read through."""

    def __init__(self, in_features, out_features, bias=True, gather_output=True, group=None,
                 sequence_parallel=False, stride=1, master_weight=None, master_bias=None, rng=None,
                 dtype=None, layout="in_out", weight=None, shared_input=None):
        super().__init__()
        self.group = group = default_group(group)
        t, r = group.size, group.rank
        divide(out_features, t * stride, "out_features" + (f" / {stride} fused parts" if stride > 1 else ""))
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.layout, self.shared_input = _check_layout(layout), shared_input
        self.consumer = shared_input.join() if shared_input is not None else 0   # its place among the readers
        dim = 1 if layout == "in_out" else 0
        self.dim, self.stride = dim, stride
        shape = (in_features, out_features) if dim == 1 else (out_features, in_features)
        rng, dtype = rng or np.random.default_rng(0), dtype or default_dtype()
        self.weight = weight if weight is not None else _shard(
            _master(shape, master_weight, _uniform(in_features), rng), Cut(dim, r, t, stride), dtype)  # A_i
        self.bias = None
        if bias:
            b = _master((out_features,), master_bias, _uniform(in_features), rng)
            self.bias = _shard(b, Cut(0, r, t, stride), dtype)  # (out/t,)

    def forward(self, x):
        if self.shared_input is not None:
            x = self.shared_input(x, self.consumer)  # (..., in): the block's one f / all-gather (or slots)
        elif self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)  # (B, T/t, in) -> (B, T, in)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)  # (..., in)
        y = self.local_linear(x)  # (..., out/t)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def local_linear(self, x):
        """Y_i = X A_i + b_i: this rank's columns, no communication."""
        return _linear(x, self.weight, self.bias, self.layout)


class RowParallelLinear(nn.Module):
    """Y = X A + b, A (in, out) split by rows, X = [X_1 ... X_t] by columns:
    Y = sum_i X_i A_i + b. Rank i holds A_i (in/t, out); the sum is one all-reduce (g),
    or with ``sequence_parallel`` a reduce-scatter to (B, T/t, out) (Korthikanti et al. 2022).
    The bias is replicated and added once, after the reduction. ``input_is_parallel=False``
    takes the full X and keeps this rank's columns (backward all-gathers dX).
    ``layout="out_in"`` stores A^T (out, in) (the cut is then on axis 1)."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=False, group=None,
                 sequence_parallel=False, master_weight=None, master_bias=None, rng=None, dtype=None,
                 layout="in_out"):
        super().__init__()
        self.group = group = default_group(group)
        t, r = group.size, group.rank
        divide(in_features, t, "in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True "
                             "(its input is the output of a ColumnParallelLinear)")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.layout = _check_layout(layout)
        dim = 0 if layout == "in_out" else 1
        self.dim = dim
        shape = (in_features, out_features) if dim == 0 else (out_features, in_features)
        rng, dtype = rng or np.random.default_rng(0), dtype or default_dtype()
        self.weight = _shard(_master(shape, master_weight, _uniform(in_features), rng), Cut(dim, r, t, 1),
                             dtype)  # A_i: (in/t, out)
        self.bias = None
        if bias:
            self.bias = _shard(_master((out_features,), master_bias, _uniform(in_features), rng), None,
                               dtype)  # (out,) replicated

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)  # (..., in) -> (..., in/t)
        y = self.local_linear(x)  # (..., out) partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)  # (B, T/t, out)
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)  # (..., out)
        return self.add_bias(y)

    def local_linear(self, x):
        """X_i A_i: this rank's partial sum of Y, before the reduction."""
        return _linear(x, self.weight, None, self.layout)

    def add_bias(self, y):
        """Y + b, the replicated bias added once, after the reduction."""
        return y + precision.weight(self.bias) if self.bias is not None else y


class _VocabParallelEmbedding(Function):
    """y = W_i[idx - start] where start <= idx < start + V/t, else 0: a partial sum whose
    sum over ranks is W[idx]. Backward scatter-adds dY into this rank's rows only."""
    def forward(self, w, idx, start):
        outside = (idx < start) | (idx >= start + w.shape[0])
        self.local = xp.where(outside, 0, idx - start)  # (B, T)
        self.keep, self.wshape = ~outside, w.shape
        return w[self.local] * self.keep[..., None]  # (B, T, C)

    def backward(self, g):
        g = g * self.keep[..., None]
        return embedding_grad(self.wshape, g.dtype, self.local, g), None, None   # (V/t, C)


class VocabParallelEmbedding(nn.Module):
    """y = W[idx], W (V, C) split by rows: rank i holds rows [i V/t, (i+1) V/t); each rank
    looks up the ids it owns (zeros elsewhere) and g (all-reduce) sums them, or with
    ``sequence_parallel`` a reduce-scatter leaves (B, T/t, C) (Megatron-LM section 3)."""

    def __init__(self, num_embeddings, embedding_dim, group=None, sequence_parallel=False,
                 master_weight=None, rng=None, dtype=None):
        super().__init__()
        self.group = group = default_group(group)
        t, r = group.size, group.rank
        n = divide(num_embeddings, t, "the vocabulary size",
                   f"Pad the vocabulary to a multiple of {t} (GPT-2 pads 50257 to 50304) "
                   "or change the tp size.")
        self.num_embeddings, self.sequence_parallel = num_embeddings, sequence_parallel
        self.vocab_start_index, self.vocab_end_index = r * n, (r + 1) * n
        w = _master((num_embeddings, embedding_dim), master_weight, lambda g, s: g.standard_normal(s),
                    rng or np.random.default_rng(0))
        self.weight = _shard(w, Cut(0, r, t, 1), dtype or default_dtype())  # (V/t, C)

    def forward(self, idx):
        idx = idx.data if isinstance(idx, Tensor) else xp.asarray(idx)
        check_indices(idx, self.num_embeddings, "embedding index")  # same ids, same error on every rank
        w = precision.weight(self.weight)                                 # (V/t, C), upcast under bf16/fp16
        y = _VocabParallelEmbedding.apply(w, idx, self.vocab_start_index)  # (B, T, C) partial
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.group)  # (B, T/t, C)
        return reduce_from_tensor_parallel_region(y, self.group)  # (B, T, C)


class _VocabParallelCrossEntropy(Function):
    """loss = mean_n (log sum_v exp(z_nv - m_n) - (z_n,y_n - m_n)) with z split by vocabulary:
    m = all-reduce(max) of the local maxima; [sum_v exp, the target's shifted logit] =
    all-reduce(sum) of the local parts (Megatron issues the two sums as two all-reduces; they
    are stacked into one here). No rank holds the full logits. Backward is local:
    dz_i = (softmax(z)_i - onehot(y)_i) / N on this rank's vocabulary slice."""
    def forward(self, logits, targets, group, vocab_start):
        Vl = logits.shape[-1]
        z = logits.reshape(-1, Vl)  # (N, V/t)
        y = targets.reshape(-1)  # (N,)
        if y.shape[0] != z.shape[0]:
            raise ValueError(f"vocab_parallel_cross_entropy: {z.shape[0]} rows of logits "
                             f"but {y.shape[0]} targets")
        zmax = z.max(axis=1)  # (N,)
        if group.size > 1:
            group.all_reduce(zmax, op="max")
        s = z - zmax[:, None]  # (N, V/t)
        e = xp.exp(s)
        mine = (y >= vocab_start) & (y < vocab_start + Vl)  # (N,) targets in my slice
        local_y = xp.where(mine, y - vocab_start, 0)
        rows = xp.arange(z.shape[0])
        sums = xp.stack([self._exp_sums(e), s[rows, local_y] * mine])  # (2, N)
        if group.size > 1:
            group.all_reduce(sums, op="sum")
        nll = xp.log(sums[0]) - sums[1]  # (N,)
        self.p = e / sums[0][:, None]  # softmax on my slice (N, V/t)
        self.rows, self.local_y, self.mine, self.shape = rows, local_y, mine, logits.shape
        return self._mean(nll, logits.dtype)

    def _exp_sums(self, e):
        return e.sum(axis=1)  # (N,): sum_v exp(z_v - m) over this rank's vocabulary

    def _mean(self, nll, dtype):
        return xp.asarray(nll.sum() / nll.shape[0], dtype=dtype)

    def backward(self, g):
        d = self.p
        d[self.rows, self.local_y] -= self.mine.astype(d.dtype)
        self._scale(d, g)
        return d.reshape(self.shape), None

    def _scale(self, d, g):
        d *= g / d.shape[0]  # dL/dz_i = g (softmax(z)_i - onehot(y)_i) / N


def vocab_parallel_cross_entropy(logits, targets, group=None, vocab_start=None):
    """Mean token cross-entropy of vocabulary-sharded logits (..., V/t) on this rank and
    int targets (...) with ids in [0, V). ``vocab_start`` defaults to rank * V/t."""
    group = default_group(group)
    targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
    Vl = logits.shape[-1]
    check_indices(targets, Vl * group.size, "cross_entropy target")
    start = group.rank * Vl if vocab_start is None else vocab_start
    return _VocabParallelCrossEntropy.apply(logits, targets, group=group, vocab_start=start)


__all__ = ["copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "partition", "divide"]
