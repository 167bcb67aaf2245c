"""The split backward, B then W (``run_backward_input``; Qi et al., 2024, "Zero Bubble
Pipeline Parallelism"). For a layer y = x W the backward is two products,

    B:  dL/dx = dL/dy W^T        what the previous pipeline stage waits for
    W:  dL/dW = x^T dL/dy        needed only by the optimizer step: it can wait

B walks the same graph in the same order as the whole backward but follows only the
edges into *activations*; every edge into a *weight tensor* (a leaf that requires grad
and is not one of ``inputs``, or what a ``param_view`` Function -- Cast, Reshape,
Permute -- makes of weights only) becomes a task for W, kept with the dL/dy it needs:

* a ``split_backward`` Function (Linear, MatMul) is called in B with only its input
  gradients asked for (``needs_input_grad`` masked) and again in W with only its weight
  gradients; it drops its input tensors in between (W reads what forward saved);
* a Function whose inputs are all weights (an embedding) runs in W only;
* any other Function that reads a weight (a fused norm) runs whole in B; the weight
  gradients it returned are held until W.

``WeightGradients.run()`` (W) replays the tasks in B's order with the whole backward's
gradient sums (``_add_pending``) and leaf accumulation, so every ``.grad`` receives the
same contributions in the same order: B then W is bit for bit the whole backward, and the
post-accumulate-grad hooks fire in the same order. A checkpointed function (recompute.py)
splits its inner backward the same way; its W joins the outer one at its place.

It reuses the whole walk's pieces (pdist/engine/backprop.py); it imports nothing from
autograd (no cycle).
"""
from pdist.engine.backprop import _accumulate_leaf, _add_pending, _topo_order, run_hooks

_active = []   # the split backwards running now, innermost last (a checkpoint's inner one joins it)
_NODE, _CALL, _HELD, _INNER = "node", "call", "held", "inner"


def current_split():
    """The ``WeightGradients`` of the split backward running now, or None (recompute.py asks)."""
    return _active[-1] if _active else None


def _weight_tensors(order, inputs):
    """ids of the weight tensors: leaves that require grad and are not ``inputs``, and what a
    ``param_view`` Function (Cast, Reshape, Permute) makes of weight tensors only."""
    keep, weight = {id(x) for x in inputs}, set()
    for t in reversed(order):                  # producers before consumers
        ctx = t._ctx
        if ctx is None:
            if id(t) not in keep:
                weight.add(id(t))
        elif ctx.param_view and all(
                id(p) in weight for p, need in zip(ctx.parents, ctx.needs_input_grad) if need):
            weight.add(id(t))
    return weight


def _finish(p, pending, owned):
    """p's gradient is complete: its hooks, then (a leaf) .grad and post-accumulate hooks."""
    g = pending.pop(id(p))
    mine = id(g) in owned and not p._hooks
    owned.discard(id(g))
    if p._hooks:
        for h in p._hooks:
            r = h(g)
            if r is not None:
                g = r
    _accumulate_leaf(p, g, mine)


def _give(parents, mask, grads, fresh, pending, owned, consumers):
    """Add grads[i] into pending for the parents in ``mask``; finish the leaves that are complete."""
    for p, need, gp in zip(parents, mask, grads):
        if not need:
            continue
        key = id(p)
        if gp is not None:
            _add_pending(pending, owned, key, gp, fresh)
        consumers[key] -= 1
        if consumers[key] == 0 and p._ctx is None and key in pending:
            _finish(p, pending, owned)


def _call(ctx, g, mask):
    """ctx.backward(g) computing only the gradients in ``mask`` (a split_backward Function)."""
    full, ctx.needs_input_grad = ctx.needs_input_grad, mask
    try:
        grads = ctx.backward(g)
    finally:
        ctx.needs_input_grad = full
    return grads if isinstance(grads, tuple) else (grads,)


def _step_input(t, g, mine, weight, consumers, pending, owned, tasks):
    """B at tensor t (not a weight), with its complete gradient g: the input-gradient edges
    now; the weight edges as a task for W (module docstring of split_backward's contract)."""
    g = run_hooks(t, g)
    ctx = t._ctx
    if ctx is None:
        _accumulate_leaf(t, g, mine and not t._hooks)
        return
    need = ctx.needs_input_grad
    wmask = tuple(n and p is not None and id(p) in weight for p, n in zip(ctx.parents, need))
    amask = tuple(n and not w for n, w in zip(need, wmask))
    if not any(wmask):
        grads = _call(ctx, g, need)
    elif not any(amask):
        tasks.append((_CALL, ctx, g, wmask))                  # e.g. an embedding: all of it is W
        return
    elif ctx.split_backward:
        grads = _call(ctx, g, amask)                          # dL/dx = dL/dy W^T only
        tasks.append((_CALL, ctx, g, wmask))                  # dL/dW = x^T dL/dy, later
        parents = ctx.parents
        ctx.parents = tuple(None if a else p for p, a in zip(parents, amask))   # W needs no input tensor
        _give(parents, amask, grads, ctx.fresh_grads, pending, owned, consumers)
        return
    else:                                                     # a small fused op (a norm): all now,
        grads = _call(ctx, g, need)                           # its weight gradients held until W
        held = tuple(gp if w else None for gp, w in zip(grads, wmask))
        tasks.append((_HELD, tuple(p if w else None for p, w in zip(ctx.parents, wmask)), wmask, held,
                      ctx.fresh_grads))
    _give(ctx.parents, amask, grads, ctx.fresh_grads, pending, owned, consumers)


def _buffers(x, out):
    """Collect the distinct arrays (their base buffers) that x holds, by id."""
    if isinstance(x, (tuple, list)):
        for y in x:
            _buffers(y, out)
    elif hasattr(x, "nbytes") and hasattr(x, "dtype") and hasattr(x, "shape"):
        while getattr(x, "base", None) is not None and hasattr(x.base, "nbytes"):
            x = x.base
        out[id(x)] = x


class WeightGradients:
    """The W half of a split backward (``Tensor.backward(defer_weights=True)``): ``run()``
    computes the weight gradients B left, accumulates them into ``.grad`` and fires the
    hooks, in the order the whole backward would; ``nbytes``: the memory held until then."""

    def __init__(self, consumers):
        self.tasks, self.consumers, self.start, self.done = [], consumers, {}, False

    @property
    def nbytes(self):
        """Bytes of the distinct buffers W holds: the dL/dy of each deferred op, what its
        forward saved (a Linear's input), the weight gradients held; not the weights."""
        bufs, weights = {}, {}
        for task in self.tasks:
            if task[0] == _INNER:
                continue
            if task[0] in (_CALL, _NODE):
                ctx = task[2] if task[0] == _NODE else task[1]
                _buffers([v for k, v in vars(ctx).items() if k != "parents"], bufs)
                _buffers([p.data for p in ctx.parents if p is not None], weights)
            _buffers(task[2] if task[0] == _CALL else task[3] if task[0] == _HELD else (), bufs)
        own = sum(int(b.nbytes) for k, b in bufs.items() if k not in weights)
        return own + sum(t[1].nbytes for t in self.tasks if t[0] == _INNER)

    def join(self, inner):
        """A checkpoint's inner split backward: its W runs here, at its place in B's order."""
        self.tasks.append((_INNER, inner))

    def run(self):
        """W: every deferred weight-gradient edge, in B's order (so the sums are the whole backward's)."""
        if self.done:
            raise RuntimeError("the weight gradients of this backward were computed already (run() once)")
        self.done, pending, owned, consumers = True, self.start, set(), self.consumers
        for task in self.tasks:
            kind = task[0]
            if kind == _INNER:
                task[1].run()
            elif kind == _HELD:
                _give(task[1], task[2], task[3], task[4], pending, owned, consumers)
            elif kind == _CALL:
                ctx, g, mask = task[1:]
                _give(ctx.parents, mask, _call(ctx, g, mask), ctx.fresh_grads, pending, owned, consumers)
            elif id(task[1]) in pending:                      # a weight tensor made by a param_view op
                t, ctx = task[1], task[2]
                g = pending.pop(id(t))
                owned.discard(id(g))
                g = run_hooks(t, g)
                _give(ctx.parents, ctx.needs_input_grad, _call(ctx, g, ctx.needs_input_grad), ctx.fresh_grads,
                      pending, owned, consumers)
        for task in self.tasks:
            if task[0] == _NODE:
                task[1]._ctx = None
        self.tasks, self.consumers = [], {}


def run_backward_input(root, grad, inputs=()):
    """B: the gradients of everything but the weights (module docstring), in the whole
    backward's order; ``inputs`` (leaves) get their .grad now. Returns the W half."""
    order, consumers = _topo_order(root)
    weight = _weight_tensors(order, inputs)
    w = WeightGradients(consumers)
    pending, owned = {}, set()
    if id(root) in weight and root._ctx is None:         # the root is a weight itself
        consumers[id(root)] = 1
        w.tasks.append((_HELD, (root,), (True,), (grad,), False))
    else:
        (w.start if id(root) in weight else pending)[id(root)] = grad
    _active.append(w)
    try:
        for t in order:
            if id(t) in weight:
                if t._ctx is not None:
                    w.tasks.append((_NODE, t, t._ctx))
                continue
            g = pending.pop(id(t), None)
            if g is None:
                continue
            mine = id(g) in owned
            owned.discard(id(g))
            _step_input(t, g, mine, weight, consumers, pending, owned, w.tasks)
    finally:
        _active.pop()
    for t in order:
        if t._ctx is not None and id(t) not in weight:   # W clears the weight nodes' (it reads them)
            t._ctx = None
    return w
