"""A tensor-parallel GPT-2 (Megatron-LM, Shoeybi et al. 2019), optionally sequence-parallel
(Korthikanti et al. 2022), equal to ``pdist.gpt.GPT`` built from the same seed.

Per block, on tp rank i of t (activations (B, T, C), C = n_head * hs; f and g as in
tensor_parallel.py):

    h     = ln_1(x)                                 replicated LayerNorm
    qkv_i = f(h) [Wq_i | Wk_i | Wv_i] + b_i         column parallel: heads [i nh/t, (i+1) nh/t)
    a_i   = attention(qkv_i, n_head / t)            (B, T, C/t), no communication
    x     = x + g(a_i Wo_i) + bo                    row parallel: one all-reduce, bias once
    x     = x + g(gelu(f(ln_2(x)) W1_i + b1_i) W2_i) + b2

The embedding is vocab-parallel (one all-reduce), the LM head reuses the wte shard
(logits_i = f(ln_f(x)) wte_i^T, (B, T, V/t)), and the loss is the vocab-parallel
cross-entropy: no rank ever holds the full logits. All-reduces per training step:
2 per layer forward + 2 per layer backward (Megatron's count), plus 1 (embedding,
forward), 1 (the head's f, backward) and 2 (loss: max, sums) = 4L + 4.

``sequence_parallel=True``: the residual stream, LayerNorms and dropout hold T/t tokens
(B, T/t, C); f becomes an all-gather along T (backward: reduce-scatter), g a
reduce-scatter (backward: all-gather). Per step 4L + 2 all-gathers, 4L + 2
reduce-scatters and 3 all-reduces: the loss's 2 and one for the replicated parameters
that only see a rank's tokens (LayerNorms, row-parallel biases, wpe), whose grads are
partial sums until ``sync_sequence_parallel_grads()`` all-reduces them (Korthikanti et al.).
Call it after ``backward()``, before the optimizer step.

Every shard is sliced from ``gpt_init``'s full master weight; ``tp_slice(name, full,
tp_rank, tp_world_size)`` gives the slice of any single-process parameter that a rank holds.
"""
from pdist import functional as F
from pdist import nn
from pdist.autograd import Function
from pdist.backend import asarray, xp
from pdist.gpt import _ZEROS, causal_self_attention, gpt_init
from pdist.parallel import tensor_parallel as tp
from pdist.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region, partition, vocab_parallel_cross_entropy)

# parameter-name suffix -> (axis, stride) of its split; every other parameter is replicated
_SPLITS = {"wte.weight": (0, 1), "attn.c_attn.weight": (1, 3), "attn.c_attn.bias": (0, 3),
           "attn.c_proj.weight": (0, 1), "mlp.c_fc.weight": (1, 1), "mlp.c_fc.bias": (0, 1),
           "mlp.c_proj.weight": (0, 1)}
# replicated parameters whose grads are partial (one sequence shard each) under sequence parallelism
_SEQUENCE_PARTIAL = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias",
                     "attn.c_proj.bias", "mlp.c_proj.bias", "wpe.weight")


def tp_slice(name, full, tp_rank, tp_world_size):
    """The part of single-process parameter ``name`` (HF GPT-2 name, full array) that tp
    rank ``tp_rank`` holds: row/column blocks for split weights, ``full`` for replicated ones.
    c_attn takes its heads' columns from each of Q, K and V."""
    for suffix, (axis, stride) in _SPLITS.items():
        if name.endswith(suffix):
            return partition(full, axis, tp_rank, tp_world_size, stride)
    return full


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


class _ShardDropout(Function):
    """Dropout on a sequence shard that equals the single-process dropout: draw the full
    (B, T, C) mask from the same generator, keep this rank's tokens."""
    def forward(self, x, p, rng, full_shape, index):
        self.m = (rng.random(full_shape)[index] >= p).astype(x.dtype) / (1.0 - p)  # (B, T/t, C)
        return x * self.m

    def backward(self, g):
        return g * self.m


class ParallelAttention(nn.Module):
    def __init__(self, cfg, prefix, seed, group, sp):
        super().__init__()
        C, m = cfg.n_embd, (lambda n: gpt_init(cfg, prefix + n, seed))
        self.n_head = cfg.n_head // group.size  # heads on this rank
        self.c_attn = ColumnParallelLinear(C, 3 * C, gather_output=False, group=group, sequence_parallel=sp,
                                           stride=3, master_weight=m("c_attn.weight"),
                                           master_bias=m("c_attn.bias"), dtype=cfg.dtype)
        self.c_proj = RowParallelLinear(C, C, input_is_parallel=True, group=group, sequence_parallel=sp,
                                        master_weight=m("c_proj.weight"), master_bias=m("c_proj.bias"),
                                        dtype=cfg.dtype)

    def forward(self, x):
        return self.c_proj(causal_self_attention(self.c_attn(x), self.n_head))  # (B, T, C/t) inside


class ParallelMLP(nn.Module):
    def __init__(self, cfg, prefix, seed, group, sp):
        super().__init__()
        C, m = cfg.n_embd, (lambda n: gpt_init(cfg, prefix + n, seed))
        self.c_fc = ColumnParallelLinear(C, 4 * C, gather_output=False, group=group, sequence_parallel=sp,
                                         master_weight=m("c_fc.weight"), master_bias=m("c_fc.bias"),
                                         dtype=cfg.dtype)
        self.c_proj = RowParallelLinear(4 * C, C, input_is_parallel=True, group=group, sequence_parallel=sp,
                                        master_weight=m("c_proj.weight"), master_bias=m("c_proj.bias"),
                                        dtype=cfg.dtype)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, 4C/t) inside


class ParallelBlock(nn.Module):
    def __init__(self, cfg, i, seed, group, sp):
        super().__init__()
        p = f"transformer.h.{i}."
        self.ln_1 = nn.LayerNorm(cfg.n_embd, dtype=cfg.dtype)
        self.attn = ParallelAttention(cfg, p + "attn.", seed, group, sp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, dtype=cfg.dtype)
        self.mlp = ParallelMLP(cfg, p + "mlp.", seed, group, sp)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Transformer(nn.Module):
    def __init__(self, cfg, seed, group, sp):
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, group=group, sequence_parallel=sp,
                                          master_weight=gpt_init(cfg, "transformer.wte.weight", seed),
                                          dtype=cfg.dtype)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, rng=_ZEROS, dtype=cfg.dtype)
        self.h = nn.ModuleList(ParallelBlock(cfg, i, seed, group, sp) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, dtype=cfg.dtype)


class TensorParallelGPT(nn.Module):
    """GPT-2 split over the tp ProcessGroup ``group`` (see the module docstring).
    ``model(idx, targets)`` -> (logits of this rank's vocabulary slice (B, T, V/t), loss);
    parameter names are the single-process ones (``tp_slice`` maps them)."""

    def __init__(self, cfg, seed=0, group=None, sequence_parallel=False):
        super().__init__()
        self.group = group = tp._default_group(group)
        check_tp_config(cfg, group.size)
        self.config, self.sequence_parallel = cfg, sequence_parallel
        self.tp_rank, self.tp_world_size = group.rank, group.size
        self.transformer = _Transformer(cfg, seed, group, sequence_parallel)
        self.drop = nn.Dropout(cfg.dropout, seed=seed)  # same generator as GPT's: same masks
        for name, p in self.named_parameters():
            if not name.endswith(tuple(_SPLITS)):  # replicated: the master value itself
                p.data = asarray(gpt_init(cfg, name, seed), dtype=cfg.dtype)
            p.name = name
        self._sequence_partial = [p for n, p in self.named_parameters()
                                  if sequence_parallel and n.endswith(_SEQUENCE_PARTIAL)]

    def embed(self, idx):
        """x_0 = dropout(wte[idx] + wpe[positions]) -> (B, T, C), or (B, T/t, C) with SP."""
        idx = xp.asarray(getattr(idx, "data", idx))
        T, t, r = idx.shape[-1], self.tp_world_size, self.tp_rank
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        if self.sequence_parallel:
            Ts = tp.divide(T, t, "the sequence length T (sequence parallelism)",
                           f"Use a sequence length that is a multiple of {t}.")
            mine = slice(r * Ts, (r + 1) * Ts)  # this rank's tokens
            x = self.transformer.wte(idx)  # (B, T/t, C): reduce-scattered along T
            x = x + self.transformer.wpe(xp.arange(mine.start, mine.stop))
            if self.drop.p > 0 and self.training:
                full = idx.shape + (self.config.n_embd,)  # (B, T, C)
                x = _ShardDropout.apply(x, self.drop.p, self.drop.rng, full, (slice(None), mine))
            return x
        return self.drop(self.transformer.wte(idx) + self.transformer.wpe(xp.arange(T)))  # (B, T, C)

    def head(self, x):
        """logits_i = f(ln_f(x)) wte_i^T -> (B, T, V/t), this rank's vocabulary slice."""
        h = self.transformer.ln_f(x)
        if self.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, self.group)  # (B, T/t, C) -> (B, T, C)
        else:
            h = copy_to_tensor_parallel_region(h, self.group)  # (B, T, C)
        return F.linear(h, self.transformer.wte.weight.T)  # (B, T, V/t)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.transformer.h:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return logits, vocab_parallel_cross_entropy(logits, targets, self.group,
                                                    self.transformer.wte.vocab_start_index)

    def sync_sequence_parallel_grads(self):
        """All-reduce (sum) the grads of the replicated parameters that saw only this rank's
        tokens (one flat all-reduce). A no-op without sequence parallelism or with t = 1."""
        ps = [p for p in self._sequence_partial if p.grad is not None]
        if not ps or self.tp_world_size == 1:
            return
        flat = xp.concatenate([p.grad.reshape(-1) for p in ps])
        self.group.all_reduce(flat)
        lo = 0
        for p in ps:
            p.grad[...] = flat[lo:lo + p.size].reshape(p.shape)
            lo += p.size

    def tp_slice(self, name, full):
        """This rank's part of the single-process array ``full`` of parameter ``name``."""
        return tp_slice(name, full, self.tp_rank, self.tp_world_size)


__all__ = ["TensorParallelGPT", "tp_slice", "check_tp_config"]
