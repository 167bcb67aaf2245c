"""``Local`` in the deterministic mode: the step's gradient as a fixed tree over granules.

    g = (1/G) S(0, G),   S(j, j+1) = d_j = dL_j/dw,   S(lo, hi) = S(lo, mid) + S(mid, hi)

This rank computes the leaves of its granules, one forward and backward per granule (the
micro-batches are blocks of them), or all of them in one batched pass with the same bits
(batched.py), each leaf keyed by the granule's index in a ``GranuleTree``; its subtree is
``det.root``. The data-parallel wrapper joins the ranks' subtrees (join.py), and
``finish_grad_sync`` here writes the root / G into every ``.grad``, rounded once to the
parameter's dtype (``Deterministic.write``). The compute runs in the mode's kernels
(``exact_kernels``, kernels.py); the model's tensor-parallel sums run in fixed blocks
(``block_model``, tensor.py), as a tp layout splits them.
"""
from pdist.engine.backend import to_numpy, xp
from pdist.engine import hooks
from pdist.parallel.deterministic.batched import batchable, batched_compute
from pdist.parallel.deterministic.context import under_context
from pdist.parallel.deterministic.kernels import exact_kernels
from pdist.parallel.deterministic.policy import Deterministic, GranuleTree
from pdist.parallel.deterministic.tensor import block_model


class GranuleCompute:
    """Mixed into ``Local`` by ``Local(model, deterministic=arg)``: ``arg`` is True (G = 16
    granules, tp_blocks = 2), a power-of-two granule count, a dict of the policy's options, or
    a ``Deterministic`` (pdist/parallel/deterministic/policy.py)."""

    def __init__(self, module, microbatches=1, policy=None, check_finite=None, deterministic=True):
        super().__init__(module, microbatches, policy, check_finite)
        self.deterministic = det = Deterministic.of(deterministic)
        det.check(1, microbatches)
        block_model(module, det.tp_blocks)            # tensor-parallel sums in fixed blocks
        det.bind(self.parameters())

    has_late_grads = True                             # the tree's root is written after the last granule

    def compute(self, x, y, loss_scale=1.0):
        return deterministic_compute(self, x, y, loss_scale)

    def finish_grad_sync(self):
        self.deterministic.write(self.parameters())   # the root (joined over dp) / G, rounded once


def deterministic_compute(local, x, y, loss_scale=1.0):
    """``Local.compute`` in the mode: the batched pass where it applies (``batchable``,
    batched.py), else one forward and backward per granule of this rank's rows (the
    micro-batches are blocks of them), each granule's gradient a leaf of the tree
    (``GranuleTree``, keyed by the granule's index); this rank's subtree goes to ``det.root``.
    Returns the mean of the granules' losses. ``loss_scale`` S multiplies each granule's loss."""
    with exact_kernels():                                 # one BLAS thread, exact scatter-adds
        det = local.deterministic
        if det.cp_chunks > 1 and not under_context(local.module):   # one process: C G chunk leaves
            if not det.batched:
                raise ValueError("deterministic mode: cp_chunks > 1 in one process runs the batched pass; drop "
                                 "batched=False")
            return batched_compute(local, x, y, loss_scale)
        if batchable(det, local.module):                  # the same bits in one pass per chunk of granules
            return batched_compute(local, x, y, loss_scale)
        return _granule_loop(local, x, y, loss_scale)


def _granule_loop(local, x, y, loss_scale):
    det, params, k = local.deterministic, local.parameters(), local.microbatches
    count, g = det.local_granules(len(x))
    tree, losses, per_mb = GranuleTree(), [], count // k
    for j in range(count):
        rows = slice(j * g, (j + 1) * g)
        with hooks.span("forward", mb=j // per_mb):
            _, loss = local.module(x[rows], y[rows])
        with hooks.span("backward", mb=j // per_mb):
            (loss * loss_scale).backward() if loss_scale != 1.0 else loss.backward()
        for hook in det.granule_hooks:               # sequence parallelism: the partial grads' tp sum
            hook()
        tree.add(j, det.leaf(params))
        losses.append(loss.data)
    det.root = tree.root()
    return sum(float(v) for v in to_numpy(xp.stack(losses))) / count


__all__ = ["GranuleCompute", "deterministic_compute"]
