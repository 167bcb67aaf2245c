"""``MixedPrecision``: the outermost layer of the chain under bf16 or fp16 (pdist/engine/precision.py).

    model = parallelize(GPT(cfg, seed), mesh, zero_stage=2, precision="bf16")
    opt = AdamW(model.parameters())        # the fp32 masters of this rank's tensors

The strategy inside (Local, TensorParallel, DataParallel, ZeRO) holds the model's low-precision
tensors: weights w (2 B), gradients g (2 B), flat buffers and shards of them. This
layer keeps, for each tensor the inner strategy's optimizer would update (a
parameter, or a ZeRO flat shard), an fp32 master W (mixed precision's "master
weights"), and gives the optimizer the masters, so AdamW's m and v are fp32 too:

    (built)              the policy, MixedPrecisionPolicy(param_dtype), handed to the chain inside
                         (``set_policy``): where its strategies round (pdist/engine/grad_rounding.py)
    zero_grad()          w <- round(W)            (the masters the optimizer updated last step)
    compute(x, y, S)     backward on S l: S, the scaler's loss scale, an argument down the chain
    sync                 g: low precision, synchronized by the inner strategy (its dtype on the wire)
    finish_grad_sync()   W.grad <- fp32(g) / S    (S = the loss scale; 1 for bf16)
    check                fp16: a non-finite g on any rank (the [loss, #non-finite] all-reduce of
                         every wrapper, so the whole mesh agrees) skips the step: no W.grad, and
                         the scaler backs off; without a scaler, check_finite raises as usual
    optimizer.step()     AdamW on W (fp32); W.grad is transient: zero_grad drops it

Memory per rank, ZeRO stage s over N ranks (Ψ padded as ZeRO pads it), the paper's
mixed-precision table: params 2Ψ (2Ψ/N at stage 3), grads 2Ψ (2Ψ/N at stages 2, 3),
optimizer states = masters + m + v = 12Ψ/N at stages 1-3 (12Ψ at stage 0).
``pdist.measure.memory.model_state_bytes`` counts the masters in ``optim_bytes`` (and alone in
``master_bytes``). The masters start as the low-precision weights, upcast (exact).
"""
from contextlib import nullcontext

import numpy as np

from pdist.engine.grad_scaler import GradScaler
from pdist.parallel.base import Strategy
from pdist.parallel.layout import Piece
from pdist.engine.precision import MixedPrecisionPolicy, low_dtype


class MixedPrecision(Strategy):
    """Wraps ``inner`` (a strategy whose model was cast with ``precision.cast_module``) and
    hands it ``policy``, ``MixedPrecisionPolicy(param_dtype)``. ``scaler``: a GradScaler
    (fp16's default: ``GradScaler()``; None for bf16)."""

    def __init__(self, inner, precision, scaler=None):
        dt = low_dtype(precision)
        if dt is None:
            raise ValueError("MixedPrecision needs precision 'bf16' or 'fp16'; fp32 needs no wrapper")
        self.inner, self.module, self.precision, self.dtype = inner, inner.module, precision, dt
        self.scaler = scaler if scaler is not None else (GradScaler() if precision == "fp16" else None)
        self.low = [t for _, t in inner.named_parameters()]
        bad = [n for n, t in inner.named_parameters() if t.dtype != dt]
        if bad:
            raise ValueError(f"MixedPrecision({precision}): tensors {bad[:3]} are not {dt}; cast the model "
                             f"with pdist.engine.precision.cast_module(model, {precision!r}) before wrapping it")
        self.masters = []
        for t in self.low:                                # a copy of each tensor's facts, fp32 data, no hooks
            m = type(t).__new__(type(t))
            m.__dict__.update(t.__dict__)
            m.data, m.grad, m._hooks, m._post_acc_hooks = t.data.astype(np.float32), None, None, None
            m.transient_grad = True
            self.masters.append(m)
        self._by_id = {id(t): m for t, m in zip(self.low, self.masters)}
        self._found_inf = False
        self.check_batch = inner.check_batch
        self.policy = MixedPrecisionPolicy(dt)
        inner.set_policy(self.policy)                     # once: the strategies inside round as one process

    microbatches = property(lambda self: self.inner.microbatches)
    has_late_grads = property(lambda self: self.inner.has_late_grads)
    pipeline = property(lambda self: self.inner.pipeline)
    seq_shards = property(lambda self: self.inner.seq_shards)
    stamps_step = property(lambda self: self.inner.stamps_step)

    @property
    def check_finite(self):
        return self.scaler is not None or self.inner.check_finite

    def named_parameters(self):
        return [(n, m) for (n, _), m in zip(self.inner.named_parameters(), self.masters)]

    def pieces(self):
        """The inner pieces, each cut out of the master instead of the low-precision tensor."""
        return [Piece(p.name, p.global_shape, p.offsets, self._by_id.get(id(p.tensor), p.tensor), p.start,
                      p.box, p.slices) for p in self.inner.pieces()]

    def span_group(self):
        return self.inner.span_group()

    def local_batch(self, x, y):
        return self.inner.local_batch(x, y)

    # ------------------------------------------------------------ the phases
    def refresh(self):
        """w <- round(W) for every tensor (before a forward reads w)."""
        for t, m in zip(self.low, self.masters):
            t.data[...] = m.data
            m.grad = None

    def zero_grad(self):
        self.refresh()
        self.inner.zero_grad()

    def _quiet(self):
        """fp16 with a scaler: an overflow is expected (the step is skipped), not warned about."""
        return np.errstate(over="ignore", invalid="ignore") if self.scaler is not None else nullcontext()

    def compute(self, x, y):
        """The inner compute with the scaler's loss scale S as its argument (backward on S l)."""
        s = self.scaler.get_scale() if self.scaler is not None else 1.0
        with self._quiet():
            return self.inner.compute(x, y, s)

    def finish_grad_sync(self):
        with self._quiet():
            self.inner.finish_grad_sync()
        inv = 1.0 / self.scaler.get_scale() if self.scaler is not None else 1.0
        for t, m in zip(self.low, self.masters):
            if t.grad is not None:
                m.grad = t.grad.astype(np.float32)        # (shape of t,) exact upcast
                if inv != 1.0:
                    m.grad *= inv                         # a power of two: exact

    def _nonfinite(self, loss):
        return self.inner._nonfinite(loss)

    def reduce_stats(self, v):
        return self.inner.reduce_stats(v)

    def collect(self, items):
        return self.inner.collect(items)

    def _raise_nonfinite(self, bad):
        if self.scaler is None:
            return super()._raise_nonfinite(bad)
        self._found_inf = True                            # every rank: the count was all-reduced
        for m in self.masters:
            m.grad = None                                 # the optimizer skips this step

    def forward_backward(self, x, y, step=None):
        """The step; with fp16's scaler, ``skipped_step`` says whether it was skipped (every rank
        agrees), ``scaler.skipped`` counts them, and ``max_consecutive_skips`` in a row raise
        NonFiniteError on every rank (grad_scaler.py)."""
        self._found_inf = False
        loss = super().forward_backward(x, y, step)
        self.skipped_step = self._found_inf
        if self.scaler is not None:
            self.scaler.record(self._found_inf)
            self.scaler.update()
        return loss

    skipped_step = False

    # ------------------------------------------------------------ state
    def after_load(self):
        self.refresh()
        self.inner.after_load()

    def state_arrays(self):
        return self.inner.state_arrays()

    def master_arrays(self):
        return [m.data for m in self.masters]

    def __call__(self, *args, **kw):
        self.refresh()
        return self.inner(*args, **kw)


__all__ = ["MixedPrecision"]
