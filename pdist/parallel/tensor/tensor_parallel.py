"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), optionally sequence-parallel
(Korthikanti et al. 2022): ``TensorParallel(model, tp_group)`` transforms the one model in
place, swapping each layer its plan names (``ModelPlan.tensor``, pdist/models/plan.py) for
the parallel one (layers.py). The strategy names no layer; the plan says, e.g. for GPT-2
(pdist/models/gpt_plan.py), per block on tp rank i of t (activations (B, T, C); f and g
are Megatron's conjugate regions, regions.py):

    h     = norm(x)                                 replicated
    qkv_i = f(h) [Wq_i | Wk_i | Wv_i] + b_i         Column(stride=3): heads [i nh/t, (i+1) nh/t)
    a_i   = attention(qkv_i, n_head / t)            (B, T, C/t), no communication
    x     = x + g(a_i Wo_i) + bo                    Row: one all-reduce, bias once
    x     = x + g(act(f(norm(x)) W1_i + b1_i) W2_i) + b2     Column, then Row

The embedding becomes vocab-parallel (Vocab, one all-reduce), the head is Column over the
vocabulary (a tied head shares the embedding's shard), logits_i = f(norm(x)) W_i^T
(B, T, V/t), and the loss becomes the vocab-parallel cross-entropy (VocabLoss): no rank
ever holds the full logits. The plan's ``heads`` are divided by t. All-reduces per
training step: 2 per layer forward + 2 per layer backward (Megatron's count), plus 1
(embedding, forward), 1 (the head's f, backward) and 2 (loss: max, sums) = 4L + 4.

``sequence_parallel=True``: the residual stream, norms and dropout hold T/t tokens
(B, T/t, C); f becomes an all-gather along T (backward: reduce-scatter), g a
reduce-scatter (backward: all-gather); the plan's ``sequence`` modules (positions,
dropout) read this rank's tokens. Per step 4L + 2 all-gathers, 4L + 2 reduce-scatters
and 3 all-reduces: the loss's 2, and in ``finish_grad_sync`` one for the replicated
parameters that saw only this rank's tokens (the plan's ``sequence_partial``: norms,
row-parallel biases, learned positions), whose grads are partial sums. Attention sees
the whole sequence (between f and g), so rotary positions need nothing.

Every shard is sliced from the model's own full weights, so the layout never
changes the initial values; each layer records its cut on its parameters (``Cut``,
layout.py), which ``pieces()`` reads. A meta model (``device="meta"``) stays meta: the
shards get shapes only, and ``materialize()`` (``parallelize`` calls it) draws this
rank's pieces alone (pdist/engine/meta.py).
"""
from pdist.models.plan import plan_of, select
from pdist.parallel.base import ParallelModule
from pdist.parallel.tensor.layers import (  # noqa: F401  (re-exported)
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy)
from pdist.parallel.tensor.transform import (  # noqa: F401  (re-exported)
    SequenceShardDropout, SequenceShardPositions, VocabParallelCrossEntropyLoss, transform)


def check_tp_config(model, tp_world_size):
    """Raise one ValueError listing every size of ``model`` (a model or its config) that does
    not divide by the tp size: the plan's ``tp_sizes`` (pdist/models/plan.py). Call on every
    rank before any collective: the config is the same everywhere, so all raise."""
    t, sizes = tp_world_size, plan_of(model).tp_sizes
    bad = [f"{what} = {n}" for what, n in sizes.items() if n % t]
    if bad:
        heads = ", ".join(f"{k} = {n}" for k, n in sizes.items() if "head" in k)
        pad = (f" Pad the vocabulary to a multiple of {t} (GPT-2 pads 50257 to 50304); the padded model is "
               "then the single-process reference." if sizes.get("vocab_size", 0) % t else "")
        raise ValueError(f"tensor parallelism over {t} ranks needs {', '.join(sizes)} divisible by {t}; not "
                         f"divisible: {', '.join(bad)}. Use a tp size that divides them (heads are split "
                         f"whole: {heads}), or change the model.{pad}")


class TensorParallel(ParallelModule):
    """``TensorParallel(model, tp_group, sequence_parallel=False)``: this rank's column, row
    and vocabulary shards of the one model, cut as its plan says (see the module docstring)."""

    def __init__(self, module, group=None, sequence_parallel=False):
        super().__init__(module, group)
        g, t = self.group, self.group.size
        self.tp_rank, self.tp_world_size, self.sequence_parallel = g.rank, t, bool(sequence_parallel)
        self.loss_weight = 1.0 / t
        self.plan = plan_of(self.module)
        check_tp_config(self.module, t)
        if t > 1:
            if not self.plan.tensor:
                raise TypeError(f"{type(self.module).__name__}'s parallel plan cuts nothing for tensor "
                                "parallelism (its ModelPlan.tensor is empty); use tp = 1 or give it a plan")
            self._transform(self.module, g, self.sequence_parallel)

    has_late_grads = property(lambda self: (self.sequence_parallel and self.tp_world_size > 1)
                              or self.inner.has_late_grads)
    seq_shards = property(lambda self: self.tp_world_size if self.sequence_parallel else 1)

    def _transform(self, model, g, sp):
        """The plan's layers swapped for the parallel ones over ``g`` (transform.py)."""
        transform(model, self.plan, g, sp)

    _sp_params = None

    def _sequence_partial_params(self):
        """The replicated parameters whose gradients are partial sums under SP (the plan's
        ``sequence_partial``): each saw only this rank's T/t tokens. Found once, at the first
        step (a pipeline stage has pruned what it does not hold by then)."""
        if self._sp_params is None:
            named = list(self.module.named_parameters())
            found = {id(p): p for pattern in self.plan.sequence_partial for _, p in select(pattern, named)}
            self._sp_params = list(found.values())
        return self._sp_params

    def local_batch(self, x, y):
        if self.sequence_parallel and x.shape[-1] % self.tp_world_size:
            raise ValueError(f"sequence parallelism over {self.tp_world_size} ranks needs a sequence length "
                             f"divisible by {self.tp_world_size}, got T = {x.shape[-1]}")
        return self.inner.local_batch(x, y)

    _partials = None      # sequence parallelism: the policy's keeper of the partial grads (grad_rounding.py)

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
        if self._partials is not None:               # SP over tp > 1 (zero_grad made it)
            self.sum_partials(self.group)

    def sum_partials(self, group):
        """g = sum_i g_i over the tp ``group``: the replicated parameters' partial gradients
        (one flat all-reduce; the precision policy's keeper rounds, grad_rounding.py)."""
        flat = self._partials.partials()
        if flat is not None:
            group.all_reduce(flat)
            self._partials.write(flat)


__all__ = ["TensorParallel", "check_tp_config", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
