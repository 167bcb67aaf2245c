"""Context parallelism: every sequence cut over the cp ranks, attention across them.

The invariant. Rank (d, c) of dp x cp trains on B/dp rows (its dp rank's) and T/cp tokens
of each (its cp rank's), so all ranks hold the same number of tokens, b = B T / (dp cp);
its loss is the mean over its own, L_dc, and the global-batch mean and its gradient are

    L = (1/(dp cp)) sum_dc L_dc,        dL/dw = (1/(dp cp)) sum_dc dL_dc/dw

so the gradients are averaged over the dp x cp ranks (``mesh.dp_cp_group``, where
DataParallel or ZeRO sit, and ZeRO shards) and the loss too. A rank's own dL_dc/dw includes
the dK/dV that other ranks' queries sent back: everything but attention is per token, so
only attention talks across the cp ranks, by ring attention (ring_attention.py: K/V chunks
round the ring; "ring-zigzag": the head-tail chunks of zigzag.py that balance the causal
work) or Ulysses (ulysses.py: all-to-all from tokens to heads and back).

    mesh = DeviceMesh(dp=2, cp=2)
    model = parallelize(GPT(cfg, seed), mesh, context_parallel="ring")   # or "ring-zigzag", "ulysses"

``ContextParallel.local_batch`` cuts the batch. Token positions are the global ones: the
plan's position modules (GPT's ``wpe``, a ``PositionShard``) read this rank's positions, and
the attention modules (the plan's ``heads``) get a ``ContextAttention`` as their ``context``,
which also gives RoPE its positions (``install``).

Composition (docs/context_parallel.md). ``install`` runs after tensor parallelism cut the
model, so the ring or the all-to-all runs on this tp rank's heads (Ulysses: n_head/tp and
n_kv_head/tp must divide by cp). Under sequence parallelism CP cuts the sequence first, and
SP cuts each cp shard into tp pieces (Megatron's nesting). A pipeline's stages each run
their attention over the cp group of that stage (same pp, dp and tp). This wrapper sits
outside DDP/ZeRO and inside ``MixedPrecision``: it cuts the batch and passes the rest
through. Refused (``check_context``): dropout.
"""
import numpy as np

from pdist import nn
from pdist.comm import self_group
from pdist.data import shard
from pdist.engine import precision
from pdist.engine.backend import xp
from pdist.models.plan import PositionShard, plan_of, put, select
from pdist.parallel.base import Local, ParallelModule
from pdist.parallel.context import zigzag
from pdist.parallel.context.ring_attention import ring_attention
from pdist.parallel.context.ulysses import check_heads, ulysses_attention
from pdist.parallel.tensor.tensor_parallel import SequenceShardPositions

MODES = {"ring": ("ring", "contiguous"), "ring-zigzag": ("ring", "zigzag"), "ulysses": ("ulysses", "contiguous")}


class ContextParallel(ParallelModule):
    """The outermost strategy under CP: cuts the global batch to this rank's B/dp rows and
    T/cp tokens and sets their positions; gradients and the loss are averaged by the
    DataParallel / ZeRO inside it, over dp x cp (see the module docstring)."""

    def __init__(self, inner, mesh, context):
        super().__init__(inner, self_group())   # one rank: no private step group (nothing to reduce here)
        self.group = mesh.cp_group
        self.mesh, self.context = mesh, context
        self.cp_rank, self.cp_world_size = mesh.cp_rank, mesh.cp_world_size
        self.local_shape = None        # (rows, tokens) of the last local batch

    seq_shards = property(lambda self: self.cp_world_size * self.inner.seq_shards)

    def span_group(self):
        """The mesh's ranks hold the whole model together (a mesh over a sub-group keeps its
        state-dict collectives there)."""
        return self.mesh.world

    def local_batch(self, x, y):
        """Rows [d B/dp, (d+1) B/dp) of dp rank d, and this cp rank's tokens of each."""
        m, cp, sp = self.mesh, self.cp_world_size, self.inner.seq_shards
        x, y = shard((x, y), m.dp_rank, m.dp_world_size)
        B, T = x.shape
        block = getattr(getattr(self.module, "config", None), "block_size", T)
        if T > block:
            raise ValueError(f"sequence length T = {T} exceeds the model's block_size {block}")
        pos = zigzag.positions(T, cp, self.cp_rank, self.context.layout)   # (T/cp,) global positions
        if sp > 1 and (T // cp) % sp:
            raise ValueError(f"context parallelism (cp = {cp}) with sequence parallelism (tp = {sp}) cuts "
                             f"each cp shard of T/cp = {T // cp} tokens over {sp} tp ranks: choose T a "
                             f"multiple of {cp * sp * (2 if self.context.layout == 'zigzag' else 1)}, got T = {T}")
        self.context.positions = pos
        xs, ys = x[:, pos], y[:, pos]
        assert xs.shape == (B, T // cp), (xs.shape, B, T, cp)
        self.local_shape = xs.shape
        return self.find(Local).local_batch(xs, ys)


class ContextAttention:
    """What the model's attention modules call under CP: ``ctx(qkv, n_head=)`` or
    ``ctx(q, k, v, n_head=, n_kv_head=)`` on this rank's tokens; ``positions``: their
    global positions (set by ``ContextParallel.local_batch``)."""

    def __init__(self, group, mode="ring"):
        self.group, (self.kind, self.layout) = group, MODES[mode]
        self.positions = None

    def positions_array(self):
        return xp.asarray(self.positions)

    def __call__(self, *tensors, n_head, n_kv_head=None):
        if self.kind == "ulysses":
            return ulysses_attention(*tensors, n_head=n_head, n_kv_head=n_kv_head, group=self.group)
        return ring_attention(*tensors, n_head=n_head, n_kv_head=n_kv_head, group=self.group, layout=self.layout)


class ContextPositions(nn.Module):
    """A position embedding read at this rank's global positions -> (T/cp, C), or under
    sequence parallelism over ``sp_group`` (t ranks) tp rank r's piece of them -> (T/(cp t), C):
    CP cuts the sequence first, SP then cuts the cp shard in t contiguous pieces (Megatron's
    nesting). Same Parameter."""

    def __init__(self, old, context, sp_group=None):
        super().__init__()
        self.weight, self.context, self.sp_group = old.weight, context, sp_group

    def forward(self, pos):
        p = self.context.positions_array()                       # (T/cp,) this cp rank's global positions
        if self.sp_group is not None:
            n = len(p) // self.sp_group.size
            p = p[self.sp_group.rank * n:(self.sp_group.rank + 1) * n]   # (T/(cp t),) this tp rank's
        return precision.embedding(p, self.weight)  # (T/cp, C) or (T/(cp t), C)


def install(model, group, mode):
    """Give the plan's attention modules a ContextAttention, its position modules this rank's
    positions. Called after tensor parallelism cut the model: the attention modules then hold
    this tp rank's heads (ring and Ulysses work on those), and a sequence-parallel position
    module (``SequenceShardPositions``) keeps its tp group, so the positions nest (CP, then SP).
    Ulysses: every attention module's local head counts must divide by cp (checked here too,
    the same on every rank; ``check_context`` checks the config before any collective).
    Returns the ContextAttention."""
    plan, ctx = plan_of(model), ContextAttention(group, mode)
    modules = list(model.named_modules())
    found = [(path, m, attrs) for pattern, attrs in plan.heads.items() for path, m in select(pattern, modules)]
    if not found:
        raise ValueError(f"context parallelism: the plan of {type(model).__name__} names no attention module "
                         "(ModelPlan.heads); add them to its plan (docs/design.md, 'Adding a model')")
    for path, m, attrs in found:
        if ctx.kind == "ulysses":
            heads = [getattr(m, a) for a in attrs]
            check_heads(heads[0], heads[-1], group.size, path)
        m.context = ctx
    for pattern, style in plan.sequence.items():
        if isinstance(style, PositionShard):
            for path, old in select(pattern, modules):
                sp = old.group if isinstance(old, SequenceShardPositions) else None
                put(model, path, ContextPositions(old, ctx, sp))
    return ctx


def token_permutation(T, cp, layout):
    """The global positions of all ranks' tokens, rank 0's first: (T,)."""
    return np.concatenate([zigzag.positions(T, cp, r, layout) for r in range(cp)])


def check_context(cfg, mesh, mode, precision_name="fp32", pipelined=False):
    """Every error a context-parallel layout can have, the same on every rank, before any
    collective. Composes with dp, tp (+SP), pp (every schedule), ZeRO 1-3 and bf16/fp16;
    refused: dropout, and Ulysses when a tp rank's heads (n_head/tp, n_kv_head/tp) do not
    divide by cp. (``precision_name`` and ``pipelined`` are accepted for the callers; every
    precision and pipeline composes.)"""
    cp = getattr(mesh, "cp_world_size", 1)
    if mode is None:
        if cp > 1:
            raise ValueError(f"DeviceMesh has cp = {cp}: pass parallelize(..., context_parallel='ring', "
                             f"'ring-zigzag' or 'ulysses')")
        return
    if mode not in MODES:
        raise ValueError(f"context_parallel must be one of {sorted(MODES)} or None, got {mode!r}")
    if cfg.dropout:
        raise ValueError("context parallelism needs dropout = 0 (the masks of a cut sequence would differ "
                         "from single-process training)")
    tp = getattr(mesh, "tp_world_size", 1)
    if MODES[mode][0] == "ulysses":
        for what, n in plan_of(cfg).tp_sizes.items():
            if "head" in what and (n % tp or (n // tp) % cp):
                raise ValueError(f"Ulysses context parallelism over cp = {cp} with tp = {tp}: {what} = {n} "
                                 f"gives {n / tp:g} heads per tp rank, not divisible by cp = {cp}. Ulysses cuts "
                                 f"each tp rank's heads over cp: choose cp dividing {what}/tp, or use "
                                 "context_parallel='ring' (it cuts tokens, not heads)")


__all__ = ["ContextParallel", "ContextAttention", "ContextPositions", "install", "check_context", "MODES",
           "token_permutation"]
