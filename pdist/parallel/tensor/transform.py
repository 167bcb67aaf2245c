"""Swapping a model's layers for the tensor-parallel ones its plan names (``ModelPlan.tensor``,
pdist/models/plan.py): ``transform(model, plan, group, sequence_parallel)``, used by
``TensorParallel`` (tensor_parallel.py) over the tp group, as torchtitan's
``parallelize_module`` applies a plan's styles: Column, Row, Vocab (the embedding) and
VocabLoss (the loss), each layer keeping its single-process parameter names.
"""
from pdist import nn
from pdist.engine import precision
from pdist.engine.autograd import Function
from pdist.engine.backend import array_module, to_numpy
from pdist.engine.meta import MetaArray, is_meta, zeros_view
from pdist.models.plan import Column, PositionShard, Row, Vocab, VocabLoss, get, put, select
from pdist.parallel.tensor.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, divide, vocab_parallel_cross_entropy)
from pdist.parallel.tensor.regions import SharedInput


class _ShardDropout(Function):
    """Dropout on a sequence shard that equals the single-process dropout: draw the full
    (B, T, C) mask from the same generator, keep this rank's tokens."""
    def forward(self, x, p, rng, full_shape, index):
        self.m = array_module(x).asarray((rng.random(full_shape)[index] >= p).astype(x.dtype) / (1.0 - p))  # host mask -> x's device
        return x * self.m

    def backward(self, g):
        return g * self.m


class SequenceShardDropout(nn.Module):
    """The model's dropout on (B, T/t, C): this rank's tokens of the full-sequence mask."""

    def __init__(self, drop, group):
        super().__init__()
        self.p, self.rng, self.group = drop.p, drop.rng, group

    def forward(self, x):
        if self.p == 0 or not self.training:
            return x
        t, r, Ts = self.group.size, self.group.rank, x.shape[1]
        full = (x.shape[0], Ts * t) + tuple(x.shape[2:])  # (B, T, C)
        return _ShardDropout.apply(x, self.p, self.rng, full, (slice(None), slice(r * Ts, (r + 1) * Ts)))


class SequenceShardPositions(nn.Module):
    """wpe on this rank's tokens: positions [r T/t, (r+1) T/t) -> (T/t, C). Same Parameter."""

    def __init__(self, wpe, group):
        super().__init__()
        self.weight, self.group = wpe.weight, group

    def forward(self, pos):
        Ts = divide(len(pos), self.group.size, "the sequence length T (sequence parallelism)")
        r = self.group.rank
        return precision.embedding(pos[r * Ts:(r + 1) * Ts], self.weight)  # (T/t, C)


class VocabParallelCrossEntropyLoss(nn.Module):
    """The model's loss on logits (B, T, V/t) holding vocabulary [r V/t, (r+1) V/t)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.group)


def _parallel_layer(model, path, old, style, g, sp, inputs):
    """The parallel layer that replaces module ``old`` at ``path`` under ``style`` (the plan's
    cut); its parameters keep their single-process names and record their cut."""
    if isinstance(style, VocabLoss):
        return VocabParallelCrossEntropyLoss(g)
    shared = get(model, style.tied_to).weight if getattr(style, "tied_to", None) else None
    meta = is_meta(old.weight.data)
    host = zeros_view if meta else to_numpy            # meta: slice zeros, stay meta
    w = host(old.weight.data) if shared is None else None
    b = host(old.bias.data) if getattr(old, "bias", None) is not None else None
    dtype, layout = old.weight.data.dtype, getattr(old, "layout", "in_out")
    a, c = old.weight.shape
    if isinstance(style, Vocab):
        new = VocabParallelEmbedding(a, c, group=g, sequence_parallel=sp, master_weight=w, dtype=dtype)
    else:
        n_in, n_out = (a, c) if layout == "in_out" else (c, a)
        kw = dict(bias=b is not None, group=g, sequence_parallel=sp, master_weight=w, master_bias=b,
                  dtype=dtype, layout=layout)
        if isinstance(style, Column):
            key = (path.rpartition(".")[0], style.shared_input)
            one = None if style.shared_input is None else inputs.setdefault(key, SharedInput(g, sp))
            new = ColumnParallelLinear(n_in, n_out, gather_output=False, stride=style.stride, weight=shared,
                                       shared_input=one, **kw)
        elif isinstance(style, Row):
            new = RowParallelLinear(n_in, n_out, input_is_parallel=True, **kw)
        else:
            raise TypeError(f"tensor-parallel plan: {path!r} has style {style!r}; use Column, Row, Vocab or "
                            "VocabLoss (pdist/models/plan.py)")
    compute = getattr(old.weight, "compute_dtype", None)      # a model cast before the swap keeps it
    for pname, prm in new._params.items():
        if prm is not None and prm is not shared:
            prm.name = f"{path}.{pname}"
            if compute is not None:
                prm.compute_dtype = compute
            if meta:
                prm.data = MetaArray(prm.data.shape, prm.data.dtype)
    return new


def transform(model, plan, g, sp):
    """Every layer the plan names becomes its parallel layer over group ``g`` (a layer tied to
    another after that one); head counts are divided by t; under SP the plan's sequence
    modules hold this rank's T/t tokens."""
    styles = list(plan.tensor.items())
    styles.sort(key=lambda kv: getattr(kv[1], "tied_to", None) is not None)
    inputs = {}                                      # (parent, name) -> SharedInput
    for pattern, style in styles:
        found = select(pattern, list(model.named_modules()))
        if not found:
            raise ValueError(f"tensor-parallel plan of {type(model).__name__}: {pattern!r} matches no module")
        for path, old in found:
            put(model, path, _parallel_layer(model, path, old, style, g, sp, inputs))
    for pattern, attrs in plan.heads.items():
        for path, m in select(pattern, list(model.named_modules())):
            for a in attrs:
                setattr(m, a, divide(getattr(m, a), g.size, f"{path}.{a}"))
    if sp:
        for pattern, style in plan.sequence.items():
            for path, old in select(pattern, list(model.named_modules())):
                shard = SequenceShardPositions if isinstance(style, PositionShard) else SequenceShardDropout
                put(model, path, shard(old, g))
        named = list(model.named_parameters())
        for pattern in plan.sequence_partial:
            if not select(pattern, named):
                raise ValueError(f"sequence-parallel plan of {type(model).__name__}: {pattern!r} matches no "
                                 "parameter")


__all__ = ["transform", "SequenceShardPositions", "SequenceShardDropout",
           "VocabParallelCrossEntropyLoss"]
