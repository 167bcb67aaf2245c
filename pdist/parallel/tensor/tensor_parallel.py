"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), optionally sequence-parallel
(Korthikanti et al. 2022): ``TensorParallel(model, tp_group)`` transforms the one
``pdist.models.gpt.GPT`` in place, swapping its layers for the parallel ones (tp_layers.py).

Per block, on tp rank i of t (activations (B, T, C), C = n_head * hs; f and g are
Megatron's conjugate regions, tp_regions.py):

    h     = ln_1(x)                                 replicated LayerNorm
    qkv_i = f(h) [Wq_i | Wk_i | Wv_i] + b_i         column parallel: heads [i nh/t, (i+1) nh/t)
    a_i   = attention(qkv_i, n_head / t)            (B, T, C/t), no communication
    x     = x + g(a_i Wo_i) + bo                    row parallel: one all-reduce, bias once
    x     = x + g(gelu(f(ln_2(x)) W1_i + b1_i) W2_i) + b2

The embedding becomes vocab-parallel (one all-reduce), the tied head reuses the wte
shard (logits_i = f(ln_f(x)) wte_i^T, (B, T, V/t)) and the loss becomes the
vocab-parallel cross-entropy: no rank ever holds the full logits. All-reduces per
training step: 2 per layer forward + 2 per layer backward (Megatron's count), plus 1
(embedding, forward), 1 (the head's f, backward) and 2 (loss: max, sums) = 4L + 4.

``sequence_parallel=True``: the residual stream, LayerNorms and dropout hold T/t tokens
(B, T/t, C); f becomes an all-gather along T (backward: reduce-scatter), g a
reduce-scatter (backward: all-gather). Per step 4L + 2 all-gathers, 4L + 2
reduce-scatters and 3 all-reduces: the loss's 2, and in ``finish_grad_sync`` one for
the replicated parameters that saw only this rank's tokens (LayerNorms, row-parallel
biases, wpe), whose grads are partial sums.

Every shard is sliced from the model's own full weights, so the layout never
changes the initial values; each parameter records where it sits in the full tensor
(``local_pieces``, layout.py). A meta model (``GPT(cfg, seed, device="meta")``) stays
meta: the shards get shapes only, and ``materialize()`` (``parallelize`` calls it) draws
this rank's pieces alone (pdist/engine/meta.py).
"""
from pdist import nn
from pdist.engine import precision
from pdist.engine.autograd import Function
from pdist.engine.backend import array_module, to_numpy
from pdist.engine.meta import MetaArray, is_meta, zeros_view
from pdist.parallel.base import ParallelModule
from pdist.parallel.tensor.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tensor_parallel_region, divide,
    gather_from_sequence_parallel_region, vocab_parallel_cross_entropy)

# replicated parameters whose grads are partial (one sequence shard each) under sequence parallelism
SEQUENCE_PARTIAL = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias",
                    "attn.c_proj.bias", "mlp.c_proj.bias", "wpe.weight")


def check_tp_config(cfg, tp_world_size):
    """Raise one ValueError listing every size that does not divide by the tp size (call on
    every rank before any collective: the config is the same everywhere, so all raise)."""
    t = tp_world_size
    bad = [f"{what} = {n}" for what, n in (("n_head", cfg.n_head), ("n_embd", cfg.n_embd),
                                           ("4*n_embd", 4 * cfg.n_embd), ("vocab_size", cfg.vocab_size))
           if n % t]
    if bad:
        pad = (f" Pad the vocabulary to a multiple of {t} (GPT-2 pads 50257 to 50304); the padded model is "
               "then the single-process reference." if cfg.vocab_size % t else "")
        raise ValueError(f"tensor parallelism over {t} ranks needs n_head, n_embd, 4*n_embd and vocab_size "
                         f"divisible by {t}; not divisible: {', '.join(bad)}. Use a tp size that divides "
                         f"them (heads are split whole: n_head = {cfg.n_head}), or change the model.{pad}")


def split_pieces(global_shape, axis, rank, t, stride=1):
    """[(local slices, global offsets)] of a tensor split along ``axis`` into t parts, each
    of ``stride`` column groups split separately (the fused [Q|K|V] has stride 3)."""
    n = global_shape[axis]
    c = n // (t * stride)
    out = []
    for j in range(stride):
        sl = [slice(0, d) for d in global_shape]
        sl[axis] = slice(j * c, (j + 1) * c)
        off = [0] * len(global_shape)
        off[axis] = j * (n // stride) + rank * c
        out.append((tuple(sl[:axis]) + (sl[axis],) + tuple(sl[axis + 1:]), tuple(off)))
    return out


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


class ParallelLMHead(nn.Module):
    """logits_i = f(x) wte_i^T: (B, T, C) -> (B, T, V/t); with SP the f is an all-gather."""

    def __init__(self, weight, group, sequence_parallel):
        super().__init__()
        self.weight, self.group, self.sequence_parallel = weight, group, sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)  # (B, T/t, C) -> (B, T, C)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)  # (B, T, C)
        return precision.linear(x, self.weight.T)  # (B, T, V/t)


class VocabParallelCrossEntropyLoss(nn.Module):
    def __init__(self, group, vocab_start):
        super().__init__()
        self.group, self.vocab_start = group, vocab_start

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_start)


class TensorParallel(ParallelModule):
    """``TensorParallel(GPT(cfg, seed), tp_group, sequence_parallel=False)``: this rank's
    column/row/vocabulary shards of the one GPT (see the module docstring)."""

    def __init__(self, module, group=None, sequence_parallel=False, check_finite=False):
        super().__init__(module, group, check_finite)
        g, t = self.group, self.group.size
        self.tp_rank, self.tp_world_size, self.sequence_parallel = g.rank, t, bool(sequence_parallel)
        self.loss_weight = 1.0 / t
        gpt = self.module
        check_tp_config(gpt.config, t)
        if t > 1:
            self._transform(gpt, g, self.sequence_parallel)

    has_late_grads = property(lambda self: (self.sequence_parallel and self.tp_world_size > 1)
                              or self.inner.has_late_grads)
    seq_shards = property(lambda self: self.tp_world_size if self.sequence_parallel else 1)

    def _transform(self, gpt, g, sp):
        cfg, C = gpt.config, gpt.config.n_embd

        def swap(parent, name, make, splits):
            old = getattr(parent, name)
            host = zeros_view if is_meta(old.weight.data) else to_numpy   # meta: slice zeros, stay meta
            w, b = host(old.weight.data), (host(old.bias.data) if getattr(old, "bias", None) is not None else None)
            new = make(w, b)
            prefix = old.weight.name.rsplit(".", 1)[0]
            for pname, axis, stride, full in splits(w, b):
                p = getattr(new, pname)
                if host is zeros_view:
                    p.data = MetaArray(p.data.shape, p.data.dtype)
                p.name = p.global_name = f"{prefix}.{pname}"
                p.global_shape = full.shape
                if axis is not None:
                    p.local_pieces = split_pieces(full.shape, axis, g.rank, g.size, stride)
            setattr(parent, name, new)
            return new

        def col(stride):
            return lambda w, b: [("weight", 1, stride, w), ("bias", 0, stride, b)]

        def row(w, b):
            return [("weight", 0, 1, w), ("bias", None, 1, b)]

        for block in gpt.transformer.h:
            a, m = block.attn, block.mlp
            swap(a, "c_attn", lambda w, b: ColumnParallelLinear(
                C, 3 * C, gather_output=False, group=g, sequence_parallel=sp, stride=3, master_weight=w,
                master_bias=b, dtype=w.dtype), col(3))
            swap(a, "c_proj", lambda w, b: RowParallelLinear(
                C, C, input_is_parallel=True, group=g, sequence_parallel=sp, master_weight=w, master_bias=b,
                dtype=w.dtype), row)
            a.n_head = cfg.n_head // g.size   # heads on this rank
            swap(m, "c_fc", lambda w, b: ColumnParallelLinear(
                C, 4 * C, gather_output=False, group=g, sequence_parallel=sp, master_weight=w, master_bias=b,
                dtype=w.dtype), col(1))
            swap(m, "c_proj", lambda w, b: RowParallelLinear(
                4 * C, C, input_is_parallel=True, group=g, sequence_parallel=sp, master_weight=w,
                master_bias=b, dtype=w.dtype), row)
        tr = gpt.transformer
        wte = swap(tr, "wte", lambda w, b: VocabParallelEmbedding(
            cfg.vocab_size, C, group=g, sequence_parallel=sp, master_weight=w, dtype=w.dtype),
            lambda w, b: [("weight", 0, 1, w)])
        gpt.lm_head = ParallelLMHead(wte.weight, g, sp)
        gpt.loss_fn = VocabParallelCrossEntropyLoss(g, wte.vocab_start_index)
        if sp:
            tr.wpe = SequenceShardPositions(tr.wpe, g)
            gpt.drop = SequenceShardDropout(gpt.drop, g)

    def local_batch(self, x, y):
        if self.sequence_parallel and x.shape[-1] % self.tp_world_size:
            raise ValueError(f"sequence parallelism over {self.tp_world_size} ranks needs a sequence length "
                             f"divisible by {self.tp_world_size}, got T = {x.shape[-1]}")
        return self.inner.local_batch(x, y)

    _partials = None      # sequence parallelism: the policy's keeper of the partial grads (grad_rounding.py)

    def _sequence_partial_params(self):
        """Every replicated parameter whose gradient is a partial sum under sequence parallelism."""
        return [p for n, p in self.module.named_parameters() if n.endswith(SEQUENCE_PARTIAL)]

    def zero_grad(self):
        """(Sequence parallelism, at the first step: the policy's keeper of the partial grads.)"""
        self.inner.zero_grad()
        if self.sequence_parallel and self.tp_world_size > 1:
            if self._partials is None:
                self._partials = self.policy.partial_grads(self._sequence_partial_params())
            self._partials.reset()

    def finish_grad_sync(self):
        """Sequence parallelism: sum over the tp group the grads of the replicated parameters
        that saw only this rank's tokens (fp32: one flat all-reduce; bf16/fp16: their unrounded
        partials, then one rounding)."""
        self.inner.finish_grad_sync()
        if self._partials is not None:          # sequence parallel over tp > 1 (zero_grad made it)
            self._partials.finish(self.group)


__all__ = ["TensorParallel", "check_tp_config", "split_pieces", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
