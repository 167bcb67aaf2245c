"""The one shape of every strategy (docs/design.md).

    model = parallelize(GPT(cfg, seed), mesh, zero_stage=1)   # or DataParallel(GPT(cfg, seed)), ...
    opt = AdamW(model.parameters(), lr=3e-4)                   # this rank's tensors (ZeRO: flat shards)
    for step in range(steps):                                  # pdist.training.train
        x, y = model.local_batch(*get_batch(step))             # this rank's rows of the global batch
        loss = model.forward_backward(x, y)                    # global-batch mean; grads synchronized
        opt.step(); opt.zero_grad()

A strategy wraps another strategy, or the plain model (which ``Local`` wraps):
``DataParallel(PipelineParallel(TensorParallel(GPT)))``. TP and PP transform the
one ``nn.Module`` in place (``model.module``); DP and ZeRO hook its gradients.
``forward_backward`` runs the same five phases for every layout, each phase a
chain through the wrappers:

    zero_grad()          inner first, then this wrapper (DDP re-points its bucket views)
    compute(x, y, S)     the innermost runner: Local's micro-batch loop, or the pipeline schedule (S: fp16's loss scale)
    finish_grad_sync()   inner first: TP's sequence-parallel grads, PP's tied embedding, then DP/ZeRO
    reduce_stats(v)      v = [loss, *counts]: each wrapper weights the loss and sums over its group


so L = (1/B) Σ_i l_i and every gradient equal single-process training on the global
batch. The step's bookkeeping (the step and batch stamped on every collective, the
non-finite check, whose count is one of the counts: step_checks.py) and the instruments
(straggler detector, fault injection, trace, memory timeline) subscribe to step hooks
around the phases (pdist/engine/hooks.py); this file imports none of the instruments. A mode (pdist/parallel/modes.py) is applied from outside: it gives each
strategy class of a chain a mixin of its own; this file names none. ``pieces()`` says where each piece of each single-process tensor lives
(layout.py): ``full_state_dict``, ``load_full_state_dict`` and
``sharded_state_dict`` follow from it for every layout. The precision is a policy that
``Local`` holds and wrappers read (``policy``, pdist/engine/precision.py).
"""
import numpy as np

from pdist import comm
from pdist.engine import hooks
from pdist.engine.backend import to_numpy, xp
from pdist.engine.meta import materialize
from pdist.engine.precision import policy_of
from pdist.parallel import modes, step_checks  # noqa: F401  (step_checks: the default step hooks)
from pdist.parallel.layout import whole
from pdist.parallel.batch_check import BatchCheck, batch_default
from pdist.parallel.nonfinite import NonFiniteCheck, finite_default
from pdist.parallel.state import StateDicts


class Strategy(StateDicts, NonFiniteCheck, BatchCheck):
    """What every layer of the chain answers. ``Local`` ends the chain; wrappers
    (``ParallelModule``) delegate to ``inner`` and add their own part."""

    check_finite = True       # (Local reads PDIST_CHECK_FINITE; wrappers inherit unless told)
    check_batch = True        # (Local reads PDIST_CHECK_BATCH; wrappers inherit)
    microbatches = 1          # backward passes per step (each parameter's grad completes this often)
    has_late_grads = False    # True when finish_grad_sync() still changes gradients after backward
    pipeline = False          # True when a pipeline runs the micro-batches (it replaces compute)
    stamps_step = True        # forward_backward stamps the training step into every collective's check
    seq_shards = 1            # activations between blocks hold T / seq_shards tokens (sequence parallel)
    mode = None               # the mode this chain runs in (pdist/parallel/modes.py), or None

    def __new__(cls, *args, **kw):
        """A wrapper takes the mode of the strategy it wraps (its first argument)."""
        inner = modes.inner_of(args, kw)
        return object.__new__(modes.in_mode(cls, inner.mode if isinstance(inner, Strategy) else None))

    def parameters(self):
        """What this rank's optimizer updates (``named_parameters()``, without the names)."""
        return [t for _, t in self.named_parameters()]

    def chain(self):
        """The strategies from this one, the outermost, to ``Local``, the innermost (last):
        ``[DataParallel, PipelineParallel, TensorParallel, Local]``."""
        out, s = [], self
        while s is not None:
            out.append(s)
            s = getattr(s, "inner", None)
        return out

    def find(self, kind):
        """The first (outermost) strategy in ``chain()`` that is a ``kind``, or None:
        ``model.find(ZeRO)``, ``model.find(Local).microbatches``."""
        return next((s for s in self.chain() if isinstance(s, kind)), None)

    def materialize(self):
        """Fill this rank's meta parameters (``GPT(cfg, seed, device="meta")``) piece by piece
        from the model's ``init_rows`` (pdist/engine/meta.py); a no-op when nothing is meta."""
        materialize(self.pieces(), getattr(self.module, "init_rows", None))
        return self

    def forward_backward(self, x, y, step=None):
        """One step's forward and backward on this rank's rows (x, y) (from ``local_batch``).
        Returns the loss, the mean over the global batch, on every rank; afterwards every
        tensor in ``parameters()`` holds its gradient of that loss, synchronized.
        ``step``: the training step (the one loop passes it; default: one more than the
        last). The step's bookkeeping and the instruments subscribe to the phases
        (pdist/engine/hooks.py; the defaults, pdist/parallel/step_checks.py: the step and the
        batch's hash stamped on every collective, so a rank that skips a step or trains on
        another batch raises on every rank; the token-id checks; the non-finite count, which
        rides on the loss's reduction and raises NonFiniteError on every rank)."""
        run = hooks.step(self, x, step)
        run("zero_grad", self.zero_grad)
        loss = run("compute", self.compute, x, y)
        run("grad_sync", self.finish_grad_sync)
        v = run("stats", self.reduce_stats, np.array([loss, *run.counts]))   # summed over the layout
        run.end()
        return float(v[0])

    steps = 0

    # ------------------------------------------------------------------- state
    def span_group(self):
        """The ranks that together hold the whole model (state-dict collectives)."""
        return comm.get_world()

    def after_load(self):
        """Refresh anything derived from the loaded tensors (ZeRO: its gathered params)."""


class Local(Strategy):
    """The end of every chain: the plain model on this process. ``compute`` runs
    ``microbatches`` forward/backward passes, each on 1/k of the rows with its loss
    scaled by 1/k (gradient accumulation: the sum is the gradient of the mean).
    Alone it talks to no rank, so it leaves the process's step stamp alone. ``policy``
    (precision.py): by default what the parameters' dtypes say, read once here.
    ``**mode``: a registered mode's keyword (pdist/parallel/modes.py), which, when it turns
    the mode on, makes this ``Local`` the mode's subclass."""

    stamps_step = False

    def __new__(cls, module=None, microbatches=1, policy=None, check_finite=None, **mode):
        return object.__new__(modes.in_mode(cls, modes.mode_of(mode)))

    def __init__(self, module, microbatches=1, policy=None, check_finite=None, **mode):
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        self.module, self.microbatches, self.inner = module, microbatches, None
        self.check_finite = finite_default() if check_finite is None else bool(check_finite)
        self.check_batch = batch_default()
        self.policy = policy_of(self.parameters()) if policy is None else policy

    def set_policy(self, policy):     # (before the first step and any DDP/ZeRO: they read has_late_grads)
        self.policy = policy

    def named_parameters(self):
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def pieces(self):
        out = []
        for name, p in self.named_parameters():
            out += whole(getattr(p, "global_name", name), p, getattr(p, "global_shape", None),
                         getattr(p, "cut", None))
        return out

    def local_batch(self, x, y):
        self._rows_of(x)
        return x, y

    def _rows_of(self, x):
        """The rows of one micro-batch of x; the same error on every rank when k does not divide them."""
        if len(x) % self.microbatches:
            raise ValueError(f"this rank's batch of {len(x)} rows does not split into {self.microbatches} "
                             f"micro-batches; use a global batch divisible by dp * microbatches")
        return len(x) // self.microbatches

    def zero_grad(self):
        self.module.zero_grad()

    @property
    def has_late_grads(self):
        """Mixed precision with micro-batches: the rounded sum is written after the last one."""
        return self.policy.late_grads(self.microbatches)

    def compute(self, x, y, loss_scale=1.0):
        k, b = self.microbatches, self._rows_of(x)
        acc = self.policy.accumulator(self.parameters(), k)     # fp32: a no-op; bf16/fp16: fp32 sums
        losses, s = [], acc.backward_scale(loss_scale)           # fp32: S/k; bf16/fp16, k > 1: S
        for i in range(k):
            with hooks.span("forward", mb=i):
                _, loss = self.module(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
            with hooks.span("backward", mb=i):
                (loss * s).backward() if s != 1.0 else loss.backward()
            acc.add()
            losses.append(loss.data)
        acc.finish()
        # the micro-batches' losses in one device -> host copy (one sync per step, not per micro-batch)
        return sum(float(v) / k for v in to_numpy(xp.stack(losses)))

    def finish_grad_sync(self):
        pass

    def reduce_stats(self, v):
        return v

    def collect(self, items):
        return list(items)

    def after_load(self):
        pass

    def state_arrays(self):
        ps = self.parameters()
        return [p.data for p in ps], [p.grad for p in ps if p.grad is not None]

    def span_group(self):
        """One process holds the whole model: state-dict collectives involve only it."""
        return comm.self_group()

    def __call__(self, *args, **kw):
        return self.module(*args, **kw)


class ParallelModule(Strategy):
    """A wrapper of the chain: ``inner`` (a strategy, or a module that ``Local`` wraps)
    and the ``group`` of ranks this strategy spans. Subclasses add their part to the
    phases; ``_aux`` is a private copy of the group for the per-step loss reduction, so
    the group's own byte counts hold only the strategy's traffic."""

    def __init__(self, inner, group=None):
        self.inner = inner if isinstance(inner, Strategy) else Local(inner)
        self.group = comm.default_group(group)
        self.module = self.inner.module
        self.check_finite = self.inner.check_finite     # (Local's: check_finite=, PDIST_CHECK_FINITE)
        self.check_batch = self.inner.check_batch
        self._aux = self.group.split(0, name=f"{self.group.name}.step") if self.group.size > 1 else None

    microbatches = property(lambda self: self.inner.microbatches)
    has_late_grads = property(lambda self: self.inner.has_late_grads)
    pipeline = property(lambda self: self.inner.pipeline)
    seq_shards = property(lambda self: self.inner.seq_shards)
    policy = property(lambda self: self.inner.policy)

    def set_policy(self, policy):
        self.inner.set_policy(policy)

    def named_parameters(self):
        return self.inner.named_parameters()

    def pieces(self):
        return self.inner.pieces()

    def span_group(self):
        """This strategy's group when it alone wraps ``Local`` (its ranks hold the whole
        model together), else the world."""
        return self.group if len(self.chain()) == 2 else comm.get_world()

    def local_batch(self, x, y):
        return self.inner.local_batch(x, y)

    def zero_grad(self):
        self.inner.zero_grad()

    def compute(self, x, y, loss_scale=1.0):
        return self.inner.compute(x, y, loss_scale)

    def finish_grad_sync(self):
        self.inner.finish_grad_sync()

    loss_weight = 1.0         # this rank's share of the loss in the sum over the group

    def reduce_stats(self, v):
        v = self.inner.reduce_stats(v)
        if self._aux is None:
            return v
        v = np.array(v, dtype=np.float64)   # [loss, *counts]: the loss weighted, the counts summed
        v[0] *= self.loss_weight
        self._aux.all_reduce(v)
        return v

    def collect(self, items):
        items = self.inner.collect(items)
        if self._aux is None:
            return items
        return [tuple(i) for part in self._aux.all_gather_object(items) for i in part]

    def after_load(self):
        self.inner.after_load()

    def state_arrays(self):
        return self.inner.state_arrays()

    def __call__(self, *args, **kw):
        return self.inner(*args, **kw)


__all__ = ["Strategy", "Local", "ParallelModule"]
