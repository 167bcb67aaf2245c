"""ZeRO stages 0-3, FSDP-style (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"; flat sharded units as in PyTorch FSDP).

Invariant: after every step, each rank's shard equals the same slice of the
single-process model trained on the same global batch. Why: each rank's loss is
the mean over its B/N rows, so the average over ranks of the gradients is the
gradient of the global mean loss; AdamW is elementwise, so updating one slice
with the slice of that gradient equals slicing the single-process update.

Memory per rank (Ψ parameters, N ranks, b bytes per element, Adam's m and v).
The paper's 16Ψ is mixed precision: fp16 params 2Ψ + fp16 grads 2Ψ + fp32 master
params, m and v 12Ψ (K = 12). pdist trains in one dtype, so here the same 16Ψ
reads, in fp32 (b = 4): params 4Ψ + grads 4Ψ + Adam m, v 8Ψ:

    stage  params  grads  Adam m, v   total         fp32 (b = 4)
    0      bΨ      bΨ     2bΨ         4bΨ           16Ψ          (plain data parallel)
    1      bΨ      bΨ     2bΨ/N       2bΨ + 2bΨ/N   8Ψ + 8Ψ/N    (P_os)
    2      bΨ      bΨ/N   2bΨ/N       bΨ + 3bΨ/N    4Ψ + 12Ψ/N   (P_os+g)
    3      bΨ/N    bΨ/N   2bΨ/N       4bΨ/N         16Ψ/N        (P_os+g+p)

Stages 1-3 flatten each unit into a buffer of Ψ_pad = ceil(Ψ_u/N)·N elements
(flat_param.py), so there Ψ means Σ_units Ψ_pad, and the formula is exact.

Sent per rank per step (ring accounting, S = bΨ bytes; docs/design.md):
    stage 0    all-reduce(grads)                        2(N-1)/N S   "2Ψ"
    stage 1, 2 reduce-scatter(grads) + all-gather(params)  2(N-1)/N S   "2Ψ"
    stage 3    all-gather before forward, again before backward,
               reduce-scatter(grads)                    3(N-1)/N S   "3Ψ"

Schedule (the hooks below): a parameter hook makes its .grad a view into the
unit's flat gradient; when the unit's last gradient is complete
(post-accumulate hook) its reduction starts asynchronously (at most one in
flight: the previous one is finished first), and stage 2/3 drop the full
gradient once it is reduced. Stage 3 also gathers a unit in a forward pre-hook,
frees it in the forward hook, gathers it again in a hook on the unit's output
(it fires before the unit's backward runs), frees it when its gradients are
done, and with ``prefetch`` starts the next unit's all-gather asynchronously.
Freed gathered units and full gradients go back to the model's buffer pool
(host_memory.BufferPool) and the next gather or gradient of that size reuses them, pages
already mapped (no page faults); ``held_bytes()`` is what the pool holds free, the RSS's
"held" share beside the formula's (pdist.measure.memory.rss_split). Building the model
ends with ``malloc_trim``: the full arrays the flattening freed go back to the OS.

Units (units.py): by default the modules the model's plan names (``ModelPlan.zero_units``: GPT-2's
blocks and final LayerNorm); every parameter in no unit (GPT-2: its two embeddings)
forms the *root* unit, hooked on the model itself:
gathered before the model's forward and freed after it, gathered again when
backward starts (a hook on the model's outputs), freed when its gradients are
done. GPT-2's token embedding is tied to the LM head, so the root stays gathered through the head in
forward and through the whole backward (the head's backward comes first, the
embedding's last). The head's ``W.T`` node keeps a view of the root's buffer
until its backward, so that buffer is not really freed after forward; the
backward all-gather lands in that same buffer (FlatParamUnit.gather_buffer) and
no second copy is made. The all-gather itself is kept, so the count is the
paper's 3Ψ.

The one shape (base.py): ``ZeRO(model, stage, dp_group)`` wraps a model or another
strategy; ``parameters()`` are this rank's flat shards (what the optimizer updates);
``forward_backward`` reduces the gradients and, at stages 1 and 2, the next
``forward_backward`` first all-gathers the parameters the optimizer updated (as
FSDP re-gathers at the next forward), so every step sends the paper's 2Ψ.
With micro-batches (gradient accumulation, or a pipeline inside) a unit's gradient
is complete after the last micro-batch's backward; its reduction starts then (the full
gradient is kept across the micro-batches, as FSDP's ``no_sync``; stage 3 gathers each
unit for every micro-batch's forward and backward: (2m + 1)Ψ per step).
ZeRO-3 gathers around each unit's forward and backward, which a pipeline's
interleaved micro-batches would repeat 2m times per step: ZeRO-3 with pp > 1 is
refused with an error (DeepSpeed refuses it too); stages 0-2 compose with any layout.
A mixture of experts under expert parallelism takes ``ExpertZeRO`` (experts.py): one unit
per expert, sharded over the edp group, reduced after backward.
"""
from pdist.engine import hooks
from pdist.engine import host_memory
from pdist.engine.backend import xp
from pdist.data import shard
from pdist.engine.meta import fill_pieces
from pdist.parallel.base import ParallelModule
from pdist.parallel.zero.gather import GatherParams
from pdist.parallel.zero.units import build_units, check_same_on_all_ranks, default_units, shard_pieces

STAGES = (0, 1, 2, 3)


def check_stage_with_pipeline(stage, pipelined):
    """ZeRO-3 gathers each unit around its forward and its backward; a pipeline's interleaved
    micro-batches would repeat that 2m times per step (3m with a split backward). Refused, the
    same on every rank, before any collective (DeepSpeed refuses it too)."""
    if stage == 3 and pipelined:
        raise ValueError("ZeRO-3 does not compose with pipeline parallelism (pp > 1): it would gather every unit 2m "
                         "times per step (3m with a zero-bubble schedule's split backward). Use zero_stage <= 2 "
                         "with pp > 1.")


class ZeRO(GatherParams, ParallelModule):
    """model = ZeRO(GPT(cfg, seed), stage=3, group=dp_group); opt = AdamW(model.parameters())
    each step: loss = model.forward_backward(*model.local_batch(x, y)); opt.step(); opt.zero_grad()

    ``parameters()`` are this rank's flat shards, one Tensor per unit: the
    optimizer is built over them (stage 0: the whole flat buffers)."""

    expert_group = None       # a mixture of experts' edp group: experts.py's ExpertZeRO

    def __init__(self, module, stage, group=None, units=None, prefetch=True):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        check_stage_with_pipeline(stage, isinstance(module, ParallelModule) and module.pipeline)
        super().__init__(module, group)
        self.stage, self.prefetch = stage, bool(prefetch)
        self.dp_rank, self.dp_world_size = self.group.rank, self.group.size
        self.loss_weight = 1.0 / self.dp_world_size
        inner_pieces = self.inner.pieces()
        unit_modules = default_units(self.module) if units is None else list(units)
        self.root, self.units, experts = build_units(self.inner, self.module, unit_modules, self.group, stage,
                                                     self.expert_group)
        check_same_on_all_ranks(self.group, stage, self.units)
        self._pieces = shard_pieces(self.units, inner_pieces)
        if any(u.meta for u in self.units):    # a meta model: fill what this rank holds, piece by piece
            fill_pieces(self._pieces if stage == 3 else inner_pieces, self.module.init_rows)
        self._inflight = None          # (unit, out, Work) of the one reduction in flight
        self._reduced = set()          # ids of units whose reduction started this step
        self._overlap = not self.inner.has_late_grads
        self._stale = stage in (1, 2)  # full params to re-gather before the next forward
        self._install_hooks(unit_modules, experts)
        self.pool = host_memory.BufferPool()   # freed unit/gradient buffers, reused next time: "held"
        for u in self.units:
            u.pool = self.pool
        host_memory.malloc_trim()      # the model's full arrays, freed by the flattening, back to the OS

    # ---------------------------------------------------------------- setup
    def _install_hooks(self, unit_modules, experts=()):
        for u in self.units:
            for p in u.params:
                p.register_hook(lambda g, u=u: u.ensure_grad_views())
                p.register_post_accumulate_grad_hook(lambda t, u=u: self._grad_ready(u))
        if self.stage == 3:
            self._install_gathers(unit_modules, experts)

    # ------------------------------------------------------ the one shape
    def named_parameters(self):
        """This rank's shards (what its optimizer updates), one per unit."""
        return [(f"{u.name}.flat_shard", u.shard) for u in self.units]

    def pieces(self):
        return list(self._pieces)

    def local_batch(self, x, y):
        """This rank's rows of the global batch: [r B/N, (r+1) B/N) (data.shard)."""
        return self.inner.local_batch(*shard((x, y), self.dp_rank, self.dp_world_size))

    def zero_grad(self):
        self.inner.zero_grad()
        self._refresh()
        for u in self.units:
            u.zero_grad()
        self._reduced.clear()

    def _refresh(self):
        """Stages 1, 2: all-gather the parameters the optimizer updated (shard -> full)."""
        if not self._stale:
            return
        works = [u.group.all_gather(u.full, u.shard.data.copy(), async_op=True) for u in self.units]
        for w in works:
            w.wait()
        self._stale = False
        hooks.event("all-gather", "all units")

    def finish_grad_sync(self):
        """Reduce every unit not reduced during backward (units that got no gradient on this
        rank reduce zeros), and wait: each shard's .grad is the global-batch mean."""
        self._finish_reductions()
        for u in self.units:
            u.ready = 0
        self._stale = self.stage in (1, 2)      # the optimizer step is next

    def _finish_reductions(self):
        self.inner.finish_grad_sync()
        for u in self.units:
            if id(u) not in self._reduced:
                u.ensure_grad_views()
                self._reduce(u)
        self._finish_reduction()

    def after_load(self):
        self.inner.after_load()
        self._stale = self.stage in (1, 2)

    def __call__(self, *args, **kw):
        self._refresh()
        return self.module(*args, **kw)

    # ------------------------------------------------------- what it holds
    def state_arrays(self):
        """(param arrays, grad arrays) live on this rank, views included
        (pdist.measure.memory counts each underlying buffer once)."""
        params = [p.data for u in self.units for p in u.params] + [u.shard.data for u in self.units]
        grads = [p.grad for u in self.units for p in u.params] + \
                [a for u in self.units for a in (u.grad_flat, u.shard.grad)]
        return params, [g for g in grads if g is not None]

    def held_bytes(self):
        """Bytes this rank holds free for reuse (the buffer pool: gathered units and full
        gradients of the last step, host_memory.BufferPool): resident, not live; the RSS
        counts them, the formula does not."""
        return self.pool.held_bytes()

    @property
    def numel(self):
        """Ψ: the model's parameter count (no padding)."""
        return sum(u.numel for u in self.units)

    @property
    def numel_padded(self):
        """Σ_units Ψ_pad: the elements the flat buffers hold (= Ψ at stage 0)."""
        return sum(u.padded for u in self.units)

    # ------------------------------------------------- gradients (all stages)
    def _grad_ready(self, u):
        u.ready += 1
        if self.stage == 3 and u.ready % len(u.params) == 0:
            u.free()                              # this micro-batch's backward is done: drop the params
        if u.ready == len(u.params) * self.microbatches and self._overlap:
            self._reduce(u)                       # the last micro-batch's gradient: reduce it

    def _reduce(self, u):
        """Start the unit's gradient reduction: all-reduce (stage 0) or reduce-scatter."""
        self._finish_reduction()                  # at most one in flight
        self._reduced.add(id(u))
        if self.stage == 3:
            u.free()                              # its backward is done: drop the full params
        if self.stage == 0:
            out, work = None, u.group.all_reduce(u.grad_flat, op=u.op, async_op=True)
        else:
            out = u.shard.grad if self.stage >= 2 and u.shard.grad is not None else \
                xp.empty(u.hi - u.lo, dtype=u.dtype)                     # (Ψ_pad/N,)
            work = u.group.reduce_scatter(out, u.grad_flat, op=u.op, async_op=True)
        self._inflight = (u, out, work)

    def _finish_reduction(self):
        if self._inflight is None:
            return
        u, out, work = self._inflight
        self._inflight = None
        work.wait()
        self._keep_shard(u, out)
        hooks.event("all-reduce" if self.stage == 0 else "reduce-scatter", u.name)

    def _keep_shard(self, u, out):
        """This rank's part of unit u's reduced gradient (``out``: its reduce-scatter's output)."""
        if self.stage == 0:
            u.shard.grad = u.grad_flat                                   # (Ψ_u,) averaged
        elif self.stage == 1:                     # keep the full gradient (P_os only)
            u.grad_flat[u.lo:u.hi] = out
            u.shard.grad = u.grad_flat[u.lo:u.hi]
        else:                                     # P_os+g: the full gradient is freed
            u.shard.grad = out
            u.drop_grads()
