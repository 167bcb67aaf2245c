"""Per-step, per-op fingerprints of activations and gradients, for finding where two runs part.

The recorder (``record(model, run_dir)``) watches every module of the model this rank holds
(the single-process names: tensor parallelism swaps a layer in place under its own path) and
notes, each training step, one fingerprint per tensor:

    ("fwd",  op, "out")     the op's output activation, in forward order
    ("bwd",  op, "grad")    dL/d(output), in the order backward reaches it; on a data-parallel
                            rank (default mode) divided by dp (its loss is the mean over its own rows; exact
                            for a power-of-two dp), so that it is the global loss's
    ("grad", param, "grad") each parameter's gradient after the step's gradient sync

A fingerprint is six numbers that combine over pieces of one tensor (its rows on DP ranks or
micro-batches, its columns or tokens on TP/SP ranks) into the full tensor's, whatever the order:

    n       elements                          (pieces: add)
    ss      sum of x^2, float64               (add)
    mx      max |x|                           (max)
    s       sum of x, float64                 (add)
    b1, b2  sum of the bit patterns u and of u^2, as uint64 modulo 2^64 (add): exact -- one
            flipped bit of one element changes b1 -- so equal (b1, b2) on two runs is the
            test of identical bits (the deterministic mode, pdist/docs/divergence.md),
            and, being sums, b1, b2 of a sharded tensor are those of the full one.

Recorded: the ops whose first input holds the call's rows (b, ...) (not a position embedding,
whose output every rank shares and whose gradient is a partial sum). Scalars (the loss of a micro-batch: a mean over its own rows) are not recorded. Pieces of one
tensor are joined when the runs are compared (``pdist.faults.diverge``): the calls of one rank
in a step add (micro-batches), ranks holding exactly equal fingerprints are replicas (a
row-parallel output on the tp ranks, a gradient after the all-reduce) and count once, the
distinct ones add. No collective runs, so recording never hangs and never costs communication.

Off unless recording: the hooks exist only inside ``with record(...)`` (the default path is the
plain ``Module.__call__`` with its empty hook lists). Each rank writes ``rank-{r}.jsonl`` (one
JSON line per step; the whole file replaced atomically after every step), rank 0 ``meta.json``.
Activation recomputation runs a forward twice and would count it twice: record without it.
"""
import json
import os

import numpy as np

from pdist.engine.autograd import Tensor
from pdist.engine.backend import to_numpy
from pdist.engine import hooks
from pdist.measure import trace

FORMAT = "pdist-fingerprint/1"
_U = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def fingerprint(a):
    """(n, ss, mx, s, b1, b2) of array ``a`` (module doc); JSON-ready Python numbers."""
    a = np.ascontiguousarray(to_numpy(a))
    f = a.astype(np.float64, copy=False).ravel()
    u = a.view(_U[a.dtype.itemsize]).ravel().astype(np.uint64)
    return [int(f.size), float(f @ f), float(np.abs(f).max()) if f.size else 0.0, float(f.sum()),
            int(u.sum(dtype=np.uint64)), int((u * u).sum(dtype=np.uint64))]


def combine(fps):
    """The fingerprint of a tensor whose pieces have fingerprints ``fps`` (module doc)."""
    n, ss, mx, s, b1, b2 = 0, 0.0, 0.0, 0.0, 0, 0
    for f in fps:
        n, ss, mx, s = n + f[0], ss + f[1], max(mx, f[2]), s + f[3]
        b1, b2 = (b1 + f[4]) % 2 ** 64, (b2 + f[5]) % 2 ** 64
    return [n, ss, mx, s, b1, b2]


def _write_atomic(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _layout(model):
    """The strategy chain with its group sizes, e.g. 'DataParallel(2) > TensorParallel(2) > Local(m=1)'."""
    if not hasattr(model, "chain"):
        return type(model).__name__
    return " > ".join(f"{type(c).__name__}({c.group.size})" if getattr(c, "group", None) is not None
                      else f"{type(c).__name__}(m={c.microbatches})" for c in model.chain())


class Recorder(hooks.StepHook):
    """The per-rank recorder (``record`` builds it; module doc). ``steps``: {step: [[phase, op,
    tensor, *fingerprint], ...]} in the order recorded on this rank."""

    order = 5

    def __init__(self, model, run_dir, rank=0, world_size=1, deterministic=None):
        os.makedirs(run_dir, exist_ok=True)      # every rank; a file in the way raises FileExistsError
        self.model, self.dir, self.rank = model, run_dir, rank
        local = model.chain()[-1] if hasattr(model, "chain") else None     # a strategy's Local (its last)
        self.module = local.module if local is not None else model
        policy = getattr(local, "policy", None)
        self.deterministic = bool(getattr(policy, "deterministic", False) or getattr(model, "deterministic", False)
                                  if deterministic is None else deterministic)
        self.steps, self.cur, self.acc, self._handles, self.rows = {}, None, {}, [], None
        dp = next((c.dp_world_size for c in model.chain() if hasattr(c, "dp_world_size")), 1) \
            if hasattr(model, "chain") else 1
        # a dp rank's loss is its rows' mean: its dL/d(out) is dp x the global one. The deterministic
        # mode backpropagates each granule's mean on every layout alike: nothing to undo there.
        self.gscale = 1.0 if self.deterministic else 1.0 / dp
        self.meta = {"format": FORMAT, "world_size": world_size, "layout": _layout(model),
                     "deterministic": self.deterministic, "dtype": None}
        self.path = os.path.join(run_dir, f"rank-{rank}.jsonl")

    # --- hooks on the modules and on the step ------------------------------------------------
    def attach(self):
        self.module.register_forward_pre_hook(self._rows_hook)
        self._handles.append((self.module, self._rows_hook))
        for name, m in self.module.named_modules():
            fn = self._forward_hook(name or "model")
            m.register_forward_hook(fn)
            self._handles.append((m, fn))
        hooks.subscribe(self)
        return self

    def detach(self):
        for m, fn in self._handles:
            for lst in (m._pre_hooks, m._post_hooks):
                if fn in lst:
                    lst.remove(fn)
        self._handles = []
        hooks.unsubscribe(self)

    def _rows_hook(self, module, args):
        """The rows b of this call of the whole model (its first input, (b, T))."""
        self.rows = getattr(args[0], "shape", (None,))[0] if args else None

    def _on_rows(self, args):
        """True when the op's first input holds this call's rows, (b, ...): ops on positions
        alone (a position embedding) give every rank the same output, and their gradients
        are partial sums over rows, not pieces: they are not recorded."""
        a = args[0] if args else None
        shape = getattr(a, "shape", ())
        return len(shape) >= 2 and (self.rows is None or shape[0] == self.rows)

    def _forward_hook(self, op):
        def hook(module, args, out):
            if self.cur is None or not self._on_rows(args):
                return None
            outs = out if isinstance(out, tuple) else (out,)
            for i, t in enumerate(outs):
                if isinstance(t, Tensor) and t.size > 1:
                    tensor = "out" if len(outs) == 1 else f"out{i}"
                    self._note("fwd", op, tensor, t.data)
                    if t.requires_grad:
                        t.register_hook(self._grad_hook(op, "grad" if len(outs) == 1 else f"grad{i}"))
            return None
        return hook

    def _grad_hook(self, op, tensor):
        def hook(g):
            if self.cur is not None:
                self._note("bwd", op, tensor, g * self.gscale if self.gscale != 1.0 else g)
            return None
        return hook

    def _note(self, phase, op, tensor, a):
        """Add one call's fingerprint; calls of one key in a step add (micro-batches)."""
        if self.meta["dtype"] is None:
            self.meta["dtype"] = str(np.dtype(a.dtype))
        key = (phase, op, tensor)
        f = fingerprint(a)
        self.acc[key] = combine([self.acc[key], f]) if key in self.acc else f

    def begin(self, s):
        self.cur, self.acc = s.step, {}

    def exit(self, s, phase):
        if phase == "grad_sync" and self.cur is not None:
            for name, p in self.module.named_parameters():
                if p.grad is not None:
                    self._note("grad", name, "grad", p.grad)

    def end(self, s):
        if self.cur is None:
            return
        self.steps[self.cur] = [[*k, *f] for k, f in self.acc.items()]
        self.cur = None
        self.flush()

    def flush(self):
        lines = [json.dumps({"step": k, "records": v}) for k, v in sorted(self.steps.items())]
        _write_atomic(self.path, "".join(line + "\n" for line in lines))
        if self.rank == 0:
            _write_atomic(os.path.join(self.dir, "meta.json"), json.dumps(self.meta, indent=1) + "\n")


class record:
    """``with fingerprint.record(model, run_dir): train(...)``: every step of ``model`` (a
    strategy or a Local) on this rank is fingerprinted into ``run_dir`` (module doc).
    ``deterministic``: None reads the model's policy (``policy.deterministic``); the flag only
    tells the comparison to demand identical bits. ``rank``/``world_size``: default from the
    world when one exists (the one ``comm.init()`` registered with the trace), else 0 and 1."""

    def __init__(self, model, run_dir, deterministic=None, rank=None, world_size=None):
        if rank is None:
            w = trace.world()
            rank, world_size = (w.rank, w.size) if w is not None else (0, 1)
        self.rec = Recorder(model, run_dir, rank, world_size or 1, deterministic)

    def __enter__(self):
        return self.rec.attach()

    def __exit__(self, *exc):
        self.rec.detach()
        self.rec.flush()
        return False


__all__ = ["record", "Recorder", "fingerprint", "combine", "FORMAT"]
