"""A pipeline in the deterministic mode: each micro-batch one granule, each stage a tree of them.

Under a pipeline a micro-batch runs in one pass, so it is one granule (dp * m = G). A stage
keeps one flat fp32 leaf per micro-batch (``PipelineTree``, the keeper the schedule calls
after each backward, in the precision policy's place: pdist/engine/grad_rounding.py), forms
the tree of its m leaves when the schedule ends, and the data-parallel wrapper joins the
trees over dp (join.py). The schedule runs in the mode's kernels (kernels.py).
"""
import numpy as np

from pdist.engine.backend import xp
from pdist.parallel.deterministic.kernels import exact_kernels
from pdist.parallel.deterministic.policy import GranuleTree, InMode


class PipelineTree:
    """A pipeline stage's keeper in the mode (the ``pipeline_grads`` interface of
    pdist/engine/grad_rounding.py). Under a pipeline a micro-batch is one granule (dp * m = G).
    ``after_backward(k, mb)`` (after virtual stage k's BACKWARD, or W, of micro-batch mb) adds
    every ``.grad`` of this rank into granule mb's flat fp32 leaf and zeroes it: the other
    chunks' gradients are zero then, and v + 0 = v, so each slot holds its own stage's value.
    ``finish()``: a tied embedding's two parts of each granule, e_j + h_j, are summed over the
    first and last stage (two terms: one order) and rounded to the weight's dtype, as one
    process sums the two uses in its ``.grad``; then the m leaves form the tree (``det.root``),
    for the data-parallel join. Memory: m leaves of Ψ_stage fp32 until the step's end."""

    def __init__(self, pipe):
        self.det, self.params, m = pipe.deterministic, pipe.inner.parameters(), pipe.num_microbatches
        self.leaves = [xp.zeros(sum(self.det.sizes), dtype=np.float32) for _ in range(m)]   # m x (Ψ_stage,)
        offs = np.cumsum([0] + self.det.sizes)
        where = {id(q): (int(offs[i]), int(offs[i + 1])) for i, q in enumerate(self.params)}
        tied = list(pipe.tied) + list(pipe.local_tied)
        self.tied = [(q, where[id(q)]) for q in tied]
        self.group = pipe.embedding_group

    def backward_scale(self, loss_scale):
        return loss_scale                       # each granule's own mean loss; 1/G at the root

    def after_backward(self, k, mb=None):
        for hook in self.det.granule_hooks:          # sequence parallelism: the partial grads' tp sum
            hook()
        leaf, off = self.leaves[mb], 0
        for q, n in zip(self.params, self.det.sizes):
            if q.grad is not None:
                leaf[off:off + n] += q.grad.reshape(-1).astype(np.float32)
                q.grad[...] = 0
            off += n

    def finish(self):
        if self.group is not None and self.tied:                 # e_j on the first stage, h_j on the last
            parts = xp.stack([xp.concatenate([v[a:b] for _, (a, b) in self.tied]) for v in self.leaves])
            self.group.all_reduce(parts, op="sum")               # (m, Σ tied)
            for v, row in zip(self.leaves, parts):
                o = 0
                for _, (a, b) in self.tied:
                    v[a:b], o = row[o:o + b - a], o + b - a
        for q, (a, b) in self.tied:                              # one rounding of e_j + h_j, as one process
            for v in self.leaves:
                v[a:b] = v[a:b].astype(q.dtype).astype(np.float32)
        tree = GranuleTree()
        for j, v in enumerate(self.leaves):
            tree.add(j, v)
        self.det.root, self.leaves = tree.root(), []

    def tied_parts(self):
        return []                                                # joined in finish(), before the dp join

    def set_tied(self, parts):
        pass


class TreePipeline(InMode):
    """``PipelineParallel`` in the mode: this stage's parameters bound to the policy, the
    ``PipelineTree`` as the step's keeper, the schedule in the mode's kernels."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.deterministic.bind(self.inner.parameters())   # this stage's parameters: a tree per micro-batch

    def grad_keeper(self):
        return PipelineTree(self)

    def _run_program(self):
        with exact_kernels():
            super()._run_program()


__all__ = ["PipelineTree", "TreePipeline"]
