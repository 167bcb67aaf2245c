"""The deterministic mode's batched pass: a rank's granules in one forward and backward,
with the bits of one pass per granule (pdist/parallel/deterministic/granules.py; the contract is
pdist/parallel/deterministic/policy.py's).

    d_j = dL_j / dw   for every granule j of the chunk, as a stack (n, Ψ) fp32
    S(lo, hi)         the GranuleTree's balanced tree: node (l, i) = (l-1, 2i) + (l-1, 2i+1)

Inside ``granules.batched(n)`` the model runs once over n stacked granules: every GEMM over
batch rows is a batched matmul with the granule's own shape (one gemm per slice), every
parameter's gradient a per-granule stack (G, *shape), and the loss the vector of the n
granules' mean losses L_j; backward of sum_j L_j gives every granule's own d_j (dL/dL_j = 1,
as the loop's backward of L_j). The stack's subtree is then summed by halving,
s <- s[0::2] + s[1::2] (lower granule on the left: the tree's own order), and the chunk's
node joins the rank's ``GranuleTree`` at its level.

Memory: a chunk of n granules holds n Ψ fp32 leaves plus the parameters' stacks (n Ψ in the
parameters' dtype); n is the largest power of two <= the rank's granules with n Ψ 4 bytes
<= ``STACK_BYTES`` (at least 1), so the stacks stay under about 2 ``STACK_BYTES``.

Under tensor (and sequence) parallelism the collectives move activations, whose rows are
the granules' own; sequence parallelism's per-granule tp sums of the partial gradients
(``det.granule_hooks``) run once on the stacks (an elementwise all-reduce, then one rounding
per element). Where it does not apply (``batchable`` False: a mixture of experts, context
parallelism) and under a pipeline (a micro-batch is one granule already), the loop of
``deterministic_compute`` runs, one pass per granule.

With ``cp_chunks`` C > 1 (one process computing the leaves of context parallelism over C ranks,
pdist/parallel/deterministic/context.py) a chunk of n granules runs as C n stacks, chunk-major
(stack k n + i: granule i's rows at token chunk k), and each stack is leaf k G + i of the tree.
"""
import contextlib

import numpy as np

from pdist.engine.backend import to_numpy, xp
from pdist.engine import hooks
from pdist.parallel.deterministic import granules
from pdist.parallel.deterministic.context import chunk_rows, one_process_chunks
from pdist.parallel.deterministic.policy import GranuleTree

STACK_BYTES = 64 << 20          # the fp32 leaves of one chunk of granules (larger chunks: fresh pages, slower)


def batchable(det, module):
    """True when the batched pass gives the loop's bits for ``module`` (module docstring);
    read once per module. Not while the model has forward hooks (a fingerprint recorder,
    pdist/measure/fingerprint.py): a hook sees one call per granule in the loop, and the same
    bits, but one call over a chunk of granules in the batched pass."""
    if module._pre_hooks or module._post_hooks:
        return False
    key = id(module)
    if getattr(det, "_batchable", (None,))[0] != key:
        ok = det.batched and not getattr(getattr(module, "config", None), "n_expert", 0)
        for _, m in module.named_modules():
            if getattr(m, "context", None) is not None:
                ok = False
        det._batchable = (key, ok)
    return det._batchable[1]


def chunk_of(count, sizes):
    """n: the largest power of two <= count with n Ψ 4 bytes <= STACK_BYTES, at least 1."""
    n, psi = count, max(sum(sizes), 1)
    while n > 1 and n * psi * 4 > STACK_BYTES:
        n //= 2
    return n


def stacked_leaves(det, params, n):
    """The chunk's leaves (n, Ψ) fp32 from the parameters' (n, *shape) stacks (exact upcast;
    -0 becomes +0, as ``Deterministic.leaf``); every ``.grad`` set to None."""
    out = xp.empty((n, sum(det.sizes)), dtype=np.float32)                                # (n, Ψ)
    off = 0
    for p, size, shape in zip(params, det.sizes, det.shapes):
        st = p.grad
        if st is None:
            out[:, off:off + size] = 0
        else:
            if tuple(st.shape) != (n,) + tuple(shape):
                raise RuntimeError(f"deterministic mode's batched pass: the gradient of {p.name or 'a parameter'} "
                                   f"has shape {tuple(st.shape)}, not a per-granule stack {(n,) + tuple(shape)} "
                                   "(an op summed it over the granules); use deterministic=Deterministic(G, "
                                   "batched=False)")
            xp.add(st.reshape(n, -1), np.float32(0), out=out[:, off:off + size])   # v + 0 = 0 + v, one pass
            p.grad = None
        off += size
    return out


def subtree(s):
    """The balanced tree over the rows of s (a power of two), by halving: (level, sum)."""
    level = 0
    while len(s) > 1:
        left = s[0::2]
        left += s[1::2]                      # in place: node (l, i) = (l-1, 2i) + (l-1, 2i+1)
        s, level = left, level + 1
    return level, s[0]


def _replay(params, saved, held, got):
    """After a chunk's backward: every parameter that got a gradient runs its post-accumulate
    hooks once on its own (whole-shaped) ``.grad`` (DDP's bucket view, ZeRO's unit counts and
    ZeRO-3's release of the gathered parameters), as after a backward of the loop."""
    for p, s, (h, a), ok in zip(params, saved, held, got):
        p.grad, p._hooks, p._post_acc_hooks = s, h, a
    for p, ok in zip(params, got):
        for hook in (p._post_acc_hooks or ()) if ok else ():
            hook(p)


def batched_compute(local, x, y, loss_scale=1.0):
    """``deterministic_compute`` in chunks of n granules, one pass each (module docstring).
    Returns the mean of the granules' losses, as the loop does."""
    det, params, C = local.deterministic, local.parameters(), local.deterministic.cp_chunks
    count, g = det.local_granules(len(x))
    n, per_mb = max(chunk_of(count * C, det.sizes) // C, 1), max(count // local.microbatches, 1)
    saved, tree, losses = [p.grad for p in params], GranuleTree(), []
    held = [(p._hooks, p._post_acc_hooks) for p in params]    # DDP's, ZeRO's hooks: run on whole gradients
    try:
        for c in range(0, count, n):
            for p in params:    # the tensor hooks of sequence parallelism's partial grads stay (elementwise)
                p.grad, p._post_acc_hooks = None, None
                p._hooks = [h for h in p._hooks or () if getattr(h, "elementwise", False)] or None
            rows = slice(c * g, (c + n) * g)
            xs, ys = (x[rows], y[rows]) if C == 1 else (chunk_rows(x[rows], C), chunk_rows(y[rows], C))
            chunked = one_process_chunks(local.module, C, n * C) if C > 1 else contextlib.nullcontext()
            with granules.batched(n * C), chunked:
                with hooks.span("forward", mb=c // per_mb):
                    _, loss = local.module(xs, ys)                                        # (C n,) L_cj
                with hooks.span("backward", mb=c // per_mb):
                    (loss * loss_scale if loss_scale != 1.0 else loss).sum().backward()
                for hook in det.granule_hooks:       # sequence parallelism: the stacks' tp sums
                    hook()
            got = [p.grad is not None for p in params]
            if C == 1:
                level, node = subtree(stacked_leaves(det, params, n))
                tree.add(c // n, node, level)
            else:                                       # stack k n + i: leaf (chunk k, granule c + i)
                for s, leaf in enumerate(stacked_leaves(det, params, n * C)):
                    tree.add((s // n) * count + c + s % n, leaf)
            losses.append(loss.data)
            _replay(params, saved, held, got)
    finally:
        for p, s, (h, a) in zip(params, saved, held):
            p.grad, p._hooks, p._post_acc_hooks = s, h, a
    det.root = tree.root()
    return sum(float(v) for v in to_numpy(xp.concatenate(losses))) / (count * C)


__all__ = ["batched_compute", "batchable", "chunk_of", "subtree", "STACK_BYTES"]
