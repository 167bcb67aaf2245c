"""The data-parallel strategies in the deterministic mode: the ranks' granule trees joined in
the tree's order (recursive doubling, join.py) in place of the all-reduce or reduce-scatter.

Each mixin goes in front of its strategy's class (pdist/parallel/modes.py): before any
collective it cuts the batch's granules over the group's ranks (``Deterministic.shard_over``:
each rank an aligned block of G / dp granules, a whole subtree), and its
``finish_grad_sync`` joins the subtrees so that every rank holds the root, which ``Local``
then writes, / G and rounded once, into the gradients (compute.py); ZeRO keeps its shard of
it. ``InMode`` carries the policy (``.deterministic``) up the chain.
"""
from pdist.comm import default_group
from pdist.parallel.deterministic.join import join, join_all
from pdist.parallel.deterministic.policy import InMode


def _shard_granules(module, group):
    """The batch's granules cut over the ``group``'s ranks (the same on every rank, before any
    collective: the sizes are the layout's)."""
    module.deterministic.shard_over(default_group(group).size, module.microbatches, module.pipeline)


class NaiveTreeJoin(InMode):
    """``DataParallelNaive``: the trees joined, then ``Local`` writes the mean."""

    def __init__(self, module, group=None, *args, **kw):
        _shard_granules(module, group)
        super().__init__(module, group, *args, **kw)

    def finish_grad_sync(self):
        join(self.deterministic, self.group)
        self.inner.finish_grad_sync()


class BucketTreeJoin(NaiveTreeJoin):
    """``DataParallel``: every gradient in its bucket view, the trees joined, ``Local`` writes the
    mean into the views; the buckets' step state reset (no all-reduce was issued)."""

    def finish_grad_sync(self):
        for p in self._param_list:
            self._into_bucket(p)
        super().finish_grad_sync()
        for b in self.buckets:
            b.ready.clear()
        self._next = 0


class ShardTreeJoin(InMode):
    """``ZeRO``: the trees joined over the group (every rank gets the whole mean, in canonical
    order), written into the flat gradients, then this rank keeps its shard."""

    def __init__(self, module, stage, group=None, *args, **kw):
        _shard_granules(module, group)
        super().__init__(module, stage, group, *args, **kw)

    def _finish_reductions(self):
        join_all(self.deterministic, self.group)
        for u in self.units:
            u.ensure_grad_views()
        self.inner.finish_grad_sync()          # Local writes the mean into the flat views
        for u in self.units:
            if self.stage == 0:
                u.shard.grad = u.grad_flat
            elif self.stage == 1:
                u.shard.grad = u.grad_flat[u.lo:u.hi]
            else:
                u.shard.grad = u.grad_flat[u.lo:u.hi].copy()
                u.drop_grads()
                if self.stage == 3:
                    u.free()                   # an expert's unit stays gathered until here (its "reduction")


class Bf16Only(InMode):
    """``MixedPrecision``: the mode covers bf16, not fp16 (its dynamic loss scale skips steps)."""

    def __init__(self, inner, precision, scaler=None):
        if precision == "fp16":
            raise ValueError("deterministic mode covers 'fp32' and 'bf16', not 'fp16' (its dynamic loss scale "
                             "skips steps on overflow); use precision='bf16' or deterministic=False")
        super().__init__(inner, precision, scaler)


__all__ = ["NaiveTreeJoin", "BucketTreeJoin", "ShardTreeJoin", "Bf16Only"]
