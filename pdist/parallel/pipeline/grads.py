"""A pipeline stage's gradients in mixed precision: the rounding points of one process.

One process with m micro-batches (``Local.compute``, pdist/engine/precision.py) rounds each
weight gradient once per micro-batch and backward pass, sums the m of them in fp32 and
rounds the mean once:

    g = round((Σ_j fp32(round(g_j))) / m)                    j = 0..m-1, in that order

A pipeline stage (Huang et al. 2019; Narayanan et al. 2021) runs the same backward of
micro-batch j on the same rows for its layers (activations and their gradients travel
between stages in the compute dtype, unrounded), so after each BACKWARD it moves its
rounded gradients into fp32 sums (``GradAccumulator``) and rounds the mean when the
schedule ends. Every schedule runs a chunk's backwards in micro-batch order, so the
sums add in the order one process adds them: equal bit for bit.

A tied embedding is the exception: one process sums the embedding's and the head's
rounded parts of micro-batch j in the low dtype, round(e_j + h_j), before accumulating;
the first stage holds the e_j, the last the h_j (its copy of the tied weight). So both
ends keep their m parts apart (m copies of the embedding's gradient, 2 bytes per element, during
the step), and ``sync_tied`` all-reduces them in the low dtype over the two ends (an
fp32 sum of two terms, one rounding: round(e_j + h_j), pdist/comm/low_precision.py),
then accumulates in fp32 and rounds the mean once, on both ends alike.
"""
import numpy as np

from pdist.engine.backend import xp
from pdist.engine.precision import GradAccumulator


class PipelineGrads:
    """``params``: the stage's low-precision parameters; ``tied``: its copy of the tied embedding
    (first or last stage of p > 1), whose parts ``sync_tied`` combines; ``ends``: the
    virtual stages that use it (0 and V - 1)."""

    def __init__(self, params, tied, ends):
        self.tied, self.ends, self.parts = list(tied), ends, []
        self.acc = GradAccumulator([q for q in params if not any(q is t for t in self.tied)])

    def after_backward(self, k):
        """After the BACKWARD of virtual stage k: this micro-batch's rounded grads into the sums."""
        if self.tied and k in self.ends:
            self.parts.append([prm.grad.copy() for prm in self.tied])
            for prm in self.tied:
                prm.grad[...] = 0
        self.acc.add()

    def finish(self, m):
        """The schedule's end: round((Σ_j g_j) / m) into every ``.grad`` but the tied one."""
        self.acc.finish(1.0 / m)

    def sync_tied(self, group):
        """round((Σ_j fp32(round(e_j + h_j))) / m) into the tied ``.grad`` on both ends."""
        for prm, parts in zip(self.tied, zip(*self.parts) if self.parts else []):
            both = xp.stack(parts)                       # (m, V, C) low precision
            group.all_reduce(both, op="sum")             # round(e_j + h_j) for every j
            acc = both[0].astype(np.float32)             # (V, C)
            for j in range(1, len(parts)):
                acc += both[j].astype(np.float32)
            acc *= 1.0 / len(parts)
            if prm.grad is None:
                prm.grad = acc.astype(prm.dtype)
            else:
                prm.grad[...] = acc.astype(prm.dtype)
        self.parts = []


__all__ = ["PipelineGrads"]
