"""Sequence parallelism in mixed precision: partial gradients summed before they are rounded.

Under sequence parallelism (Korthikanti et al. 2022) rank i of t holds tokens
[i T/t, (i+1) T/t) of the residual stream, so the replicated parameters that act on it
(the LayerNorms, the row-parallel biases, wpe: ``tensor_parallel.SEQUENCE_PARTIAL``) get
a *partial* gradient, g = Σ_i g_i, summed over the tp group. In fp32 pdist all-reduces
the g_i. In bf16/fp16 one process rounds the whole sum once per micro-batch,
round(g); rounding each g_i first would add a rounding per rank. So for these
parameters the backward hands the gradient on unrounded (in the compute dtype,
``precision.unrounded``), a hook keeps micro-batch j's partial g_i^(j) and leaves a zero
in ``.grad``, and at the end of the step (``finish``):

    G^(j) = Σ_i g_i^(j)                         one all-reduce of every micro-batch's partials,
                                                in the compute dtype (the whole sum of one process)
    .grad = round((Σ_j fp32(round(S G^(j)))) / k)   S: the loss scale (in g already); j = 0..k-1

the rounding points of ``GradAccumulator`` (one process with k micro-batches; k = 1:
round(G)). Equal to one process up to the order of the compute-dtype sum (float64 in
the tests: far below a bf16 ulp). Memory: k partials of these small tensors (2 C per
LayerNorm, C per bias, the whole wpe: block_size x C), in the compute dtype, during the step.
"""
import numpy as np

from pdist.engine.backend import xp


class PartialGrads:
    """The sequence-partial low-precision ``params`` of this rank; ``finish(group)`` sums
    them over ``group`` (the tp group) and writes the rounded average into ``.grad``."""

    def __init__(self, params):
        self.params, self.parts = list(params), {}
        for p in self.params:
            p.unrounded_grad = True
            p.register_hook(self._keeper(p))

    def _keeper(self, p):
        def keep(g):                                   # g: this backward's partial, compute dtype
            self.parts.setdefault(id(p), []).append(xp.array(g, copy=True))   # (ZeRO-3 may have freed p.data)
            return xp.zeros(g.shape, dtype=p.dtype)    # .grad gets 0: the value comes in finish
        return keep

    def reset(self):
        self.parts = {}

    def finish(self, group):
        have = [p for p in self.params if id(p) in self.parts]
        if not have:
            return
        k = len(self.parts[id(have[0])])
        if any(len(self.parts[id(p)]) != k for p in have):
            raise RuntimeError("sequence parallelism: the partial gradients saw different numbers of "
                               "backward passes in one step")
        flat = xp.concatenate([self.parts[id(p)][j].reshape(-1) for j in range(k) for p in have])
        group.all_reduce(flat)                         # (k Σ|p|,) in the compute dtype
        lo = 0
        sums = {}
        for j in range(k):
            for p in have:
                n = self.parts[id(p)][j].size
                g = flat[lo:lo + n].astype(p.dtype).astype(np.float32)   # fp32(round(G^(j))), flat
                lo += n
                if j == 0:
                    sums[id(p)] = g
                else:
                    sums[id(p)] += g
        for p in have:
            s = sums[id(p)]
            if k > 1:
                s *= 1.0 / k                           # GradAccumulator.finish: ÷ k, then one rounding
            if p.grad is None:
                p.grad = s.astype(p.dtype).reshape(self.parts[id(p)][0].shape)
            else:
                p.grad[...] = s.astype(p.dtype).reshape(p.grad.shape)
        self.parts = {}


__all__ = ["PartialGrads"]
