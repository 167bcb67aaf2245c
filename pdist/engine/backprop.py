"""The backward walk of pdist.engine.autograd: one pass over the graph, in reverse
topological order, applying the chain rule

    dL/dx_i = sum over uses y = f(..., x_i, ...) of  (dy/dx_i)^T dL/dy

A tensor's gradient is complete once every consumer has contributed (its count
of graph edges, from ``_topo_order``); its hooks run then, before it flows
further back. A leaf's gradient is added into ``.grad`` (``_accumulate_leaf``)
as soon as it is complete, so post-accumulate-grad hooks (DDP, ZeRO) fire as
early as possible. Gradient sums are made in place where the engine owns an
array (``_add_pending``). No graph is kept after backward (``retain_graph=False``).

The split backward (B, then W: ``Tensor.backward(defer_weights=True)``) is
pdist/engine/split_backward.py; it reuses this walk's gradient sums and leaf accumulation.

The walk reads tensors' ``_ctx`` (their Function), ``_hooks``, ``grad`` and
``_post_acc_hooks`` only; it imports nothing from autograd (no cycle).
"""


def _topo_order(root):
    """Tensors with a grad_fn reachable from root, in reverse topological order,
    and for every tensor the number of graph edges into it (its consumer count)."""
    order, consumers = [], {id(root): 0}
    visited = set()
    stack = [(root, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        if id(t) in visited:
            continue
        visited.add(id(t))
        stack.append((t, True))
        ctx = t._ctx
        if ctx is None:
            continue
        for p in ctx.parents:
            if p is not None and p.requires_grad:
                consumers[id(p)] = consumers.get(id(p), 0) + 1
                if id(p) not in visited:
                    stack.append((p, False))
    order.reverse()
    return order, consumers


def run_hooks(t, g):
    """t's tensor hooks on its complete gradient g, in order; a hook's non-None result replaces g."""
    for h in t._hooks or ():
        r = h(g)
        if r is not None:
            g = r
    return g


def run_backward(root, grad):
    """Walk the graph from ``root`` back to its leaves with dL/d(root) = ``grad``: each
    Function's backward once, in reverse topological order; each tensor's hooks when its
    gradient is complete; each leaf's .grad accumulated, post-accumulate hooks after."""
    order, consumers = _topo_order(root)
    pending = {id(root): grad}
    owned = set()  # ids of pending arrays nobody else references: summed into in place, adopted as .grad
    for t in order:
        g = pending.pop(id(t), None)
        if g is None:
            continue
        mine = id(g) in owned
        owned.discard(id(g))
        g = run_hooks(t, g)
        ctx = t._ctx
        if ctx is None:
            _accumulate_leaf(t, g, mine and not t._hooks)
            continue
        grads = ctx.backward(g)
        if not isinstance(grads, tuple):
            grads = (grads,)
        fresh = ctx.fresh_grads
        for p, need, gp in zip(ctx.parents, ctx.needs_input_grad, grads):
            if not need:
                continue
            key = id(p)
            if gp is not None:
                _add_pending(pending, owned, key, gp, fresh)
            consumers[key] -= 1
            if consumers[key] == 0 and p._ctx is None and key in pending:
                # a leaf whose every consumer has contributed: finish it now, so
                # post-accumulate hooks fire as early as possible (DDP overlap)
                lg = pending.pop(key)
                mine = id(lg) in owned and not p._hooks
                owned.discard(id(lg))
                if p._hooks:
                    for h in p._hooks:
                        r = h(lg)
                        if r is not None:
                            lg = r
                _accumulate_leaf(p, lg, mine)
    # no graph is kept after backward (like retain_graph=False)
    for t in order:
        if t._ctx is not None:
            t._ctx = None


def _add_pending(pending, owned, key, gp, fresh):
    """pending[key] += gp. The sum is made in place when one side is owned (made by the
    engine, or by a Function whose ``fresh_grads`` says its gradients are new arrays held
    nowhere else) and has the sum's shape and dtype; else a new array, owned from then on.
    a + b and b + a are the same floats, so the order of the operands changes nothing."""
    prev = pending.get(key)
    if prev is None:
        pending[key] = gp
        if fresh:
            owned.add(id(gp))
        return
    if prev.shape == gp.shape and prev.dtype == gp.dtype:
        if id(prev) in owned:
            prev += gp
            return
        if fresh:
            gp += prev
            pending[key] = gp
            owned.add(id(gp))
            return
    owned.discard(id(prev))
    s = pending[key] = prev + gp
    owned.add(id(s))


def _accumulate_leaf(t, g, owned=False):
    """t.grad = g (a copy, or g itself when the engine owns it and it fits), or t.grad += g."""
    if g.shape != t.data.shape and g.shape[1:] != t.data.shape:
        g = g.reshape(t.data.shape)      # (a stack (k, *shape) of k gradients stays: a substituted kernel's)
    if t.grad is None:
        if owned and g.dtype == t.data.dtype and g.flags.c_contiguous and g.base is None:
            t.grad = g  # nobody else holds this array: no copy
        else:
            t.grad = g.astype(t.data.dtype, order="C", copy=True)
    else:
        t.grad += g
    if t._post_acc_hooks:
        for h in t._post_acc_hooks:
            h(t)

