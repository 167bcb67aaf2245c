"""Where mixed precision rounds a step's gradients, each beside its fp32 twin that does not.

A strategy asks its precision policy (pdist/engine/precision.py) for a keeper and calls
it at fixed points of the step; it never asks which dtype it holds. The bf16/fp16
keeper puts one process's rounding points there (Micikevicius et al., 2018: fp32 sums
of low-precision gradients); its fp32 twin does what plain fp32 code does there --
nothing, or the one all-reduce -- with no copy and no extra pass.

1. k micro-batches (``Local.compute``; ``policy.accumulator``). Each backward runs on
   l_j S (S: fp16's loss scale; no 1/k), its weight gradients rounded once per use, then

       g = round((Σ_j fp32(round(g_j))) / k)                 j = 0..k-1, in that order

   (``GradAccumulator``: 4 bytes per parameter during the step, Megatron's main_grad).
   fp32 (``FullGradAccumulator``): backward on l_j S / k, summed in ``.grad`` by backward
   itself. The data-parallel average over N ranks rounds at the same points
   (pdist/comm/low_precision.py), so DP(N) equals one process with N micro-batches.

2. A pipeline stage (Huang et al. 2019; Narayanan et al. 2021; ``policy.pipeline_grads``)
   runs micro-batch j's backward on the same rows, activations travelling unrounded, and
   sums as in 1 after every BACKWARD; every schedule runs a chunk's backwards in
   micro-batch order, so the sums add in one process's order. A tied embedding (GPT-2's
   wte) is the exception: one process sums the embedding's and the head's rounded parts
   in the low dtype, round(e_j + h_j), before accumulating, and the first and last stage
   each hold one part. So both ends keep their m parts (m copies of its gradient, 2 bytes per
   element): ``tied_parts()`` hands them to the pipeline, which all-reduces them over the two
   ends (an fp32 sum of two terms, one rounding), and ``set_tied`` accumulates and rounds the
   mean, on both ends alike. fp32 (``FullPipelineGrads``): backward on l_j S / m;
   ``tied_parts()`` is the copies' ``.grad`` itself, summed in place by the pipeline's
   all-reduce (Megatron's embedding group).

3. Sequence parallelism (Korthikanti et al. 2022; ``policy.partial_grads``): the
   replicated parameters acting on T/t tokens (LayerNorms, row-parallel biases, wpe) get
   partial gradients, g = Σ_i g_i over the tp group. Rounding each g_i would round once
   more than one process, so their backward hands the gradient on unrounded
   (``precision.unrounded``), a hook keeps micro-batch j's partial and leaves 0 in
   ``.grad``; ``partials()`` hands every g_i^(j) in one flat buffer to tensor parallelism,
   which all-reduces it over tp (G^(j) = Σ_i g_i^(j), in the compute dtype), and ``write``
   rounds:

       .grad = round((Σ_j fp32(round(G^(j)))) / k)           (k = 1: round(G))

   the rounding points of 1 (equal up to the order of the compute-dtype sum: float64 in
   the tests, far below a bf16 ulp). fp32 (``FullPartialGrads``): ``partials()`` is the
   summed ``.grad`` flat, ``write`` copies the all-reduced sum back.

The keepers round; the strategies communicate: no keeper calls a collective.
"""
import numpy as np

from pdist.engine.backend import is_low, xp


class FullGradAccumulator:
    """fp32 (and any k = 1): backward on S l_j / k; backward itself sums into ``.grad``."""

    def __init__(self, microbatches):
        self.k = microbatches

    def backward_scale(self, loss_scale):
        return loss_scale / self.k

    def add(self):
        pass

    def finish(self):
        pass


class GradAccumulator:
    """bf16/fp16, k > 1: after each backward ``add()`` moves every low-precision ``.grad``
    into an fp32 sum (zeroing it in place, so views into flat buffers stay views);
    ``finish()`` writes round(sum / k) back."""

    def __init__(self, params, microbatches):
        self.params = [p for p in params if is_low(p.dtype)]
        self.k, self.sums = microbatches, {}

    def backward_scale(self, loss_scale):
        return loss_scale                                 # no 1/k: the mean is taken in fp32

    def add(self):
        for p in self.params:
            if p.grad is None:
                continue
            s = self.sums.get(id(p))
            if s is None:
                self.sums[id(p)] = p.grad.astype(np.float32)
            else:
                s += p.grad.astype(np.float32)
            p.grad[...] = 0

    def finish(self):
        for p in self.params:
            s = self.sums.get(id(p))
            if s is not None:
                s *= 1.0 / self.k                         # the mean, before the one rounding
                p.grad[...] = s.astype(p.dtype)
        self.sums = {}


class FullPipelineGrads(FullGradAccumulator):
    """fp32: a stage's m backwards sum into ``.grad``; ``tied_parts()``: the tied copies'
    ``.grad``, which the pipeline all-reduces (sums) in place over the first and last stage."""

    def __init__(self, tied, microbatches):
        super().__init__(microbatches)
        self.tied = list(tied)

    def after_backward(self, k, mb=None):
        pass

    def tied_parts(self):
        for prm in self.tied:
            prm.grad = xp.zeros_like(prm.data) if prm.grad is None else xp.ascontiguousarray(prm.grad)
        return [prm.grad for prm in self.tied]

    def set_tied(self, parts):
        pass                                             # summed in place


class PipelineGrads(GradAccumulator):
    """bf16/fp16: ``params``, the stage's parameters; ``tied``, its copy of a tied embedding
    (first or last stage of p > 1); ``ends``, the virtual stages that use it (0, V - 1);
    ``local_tied``: a tied embedding whose both ends are on this rank (rank 0 of a V-shaped
    schedule), its two parts of micro-batch j added in the low dtype, round(e_j + h_j),
    when the second arrives, as one process adds them."""

    def __init__(self, params, tied, ends, microbatches, local_tied=()):
        self.tied, self.ends, self.parts = list(tied), ends, []
        self.local, self.halves = list(local_tied), {}
        super().__init__([q for q in params if not any(q is t for t in self.tied)], microbatches)

    def after_backward(self, k, mb=None):
        """After the BACKWARD (or W) of micro-batch mb at virtual stage k: its rounded grads into the sums."""
        if self.local and k in self.ends:
            first = self.halves.pop(mb, None)
            if first is None:                            # the first part of mb: held, out of .grad
                self.halves[mb] = [prm.grad.copy() for prm in self.local]
                for prm in self.local:
                    prm.grad[...] = 0
            else:
                for prm, part in zip(self.local, first):
                    prm.grad += part                     # round(e_j + h_j), one rounding
        if self.tied and k in self.ends:
            self.parts.append([prm.grad.copy() for prm in self.tied])
            for prm in self.tied:
                prm.grad[...] = 0
        self.add()

    def tied_parts(self):
        """Each tied weight's m parts of this end, stacked (m, V, C) in the low dtype."""
        return [xp.stack(parts) for parts in (zip(*self.parts) if self.parts else [])]

    def set_tied(self, summed):
        """round((Σ_j fp32(round(e_j + h_j))) / m) into the tied ``.grad`` on both ends, from the
        parts summed over the two ends (each round(e_j + h_j))."""
        for prm, both in zip(self.tied, summed):     # both: (m, V, C)
            acc = both[0].astype(np.float32)             # (V, C)
            for j in range(1, len(both)):
                acc += both[j].astype(np.float32)
            acc *= 1.0 / len(both)
            if prm.grad is None:
                prm.grad = acc.astype(prm.dtype)
            else:
                prm.grad[...] = acc.astype(prm.dtype)
        self.parts = []


class FullPartialGrads:
    """fp32: ``partials()`` the partial ``.grad`` of ``params`` as one flat buffer (ZeRO-3 may
    have freed their data; the grads are there), for one all-reduce; ``write(flat)`` the sum back."""

    def __init__(self, params):
        self.params = list(params)

    def reset(self):
        pass

    def partials(self):
        self._grads = [p.grad for p in self.params if p.grad is not None]
        return xp.concatenate([g.reshape(-1) for g in self._grads])

    def write(self, flat):
        lo = 0
        for g in self._grads:
            g[...] = flat[lo:lo + g.size].reshape(g.shape)
            lo += g.size


class PartialGrads(FullPartialGrads):
    """bf16/fp16: the sequence-partial ``params`` leave backward unrounded; a hook keeps each
    backward's partial; ``partials()`` hands them over in one flat buffer (for the tp
    all-reduce), ``write(flat)`` rounds each micro-batch's sum and writes the rounded average
    into ``.grad``."""

    def __init__(self, params):
        super().__init__(params)
        self.parts = {}
        for p in self.params:
            p.unrounded_grad = True
            p.register_hook(self._keeper(p))

    def _keeper(self, p):
        def keep(g):                                   # g: this backward's partial, compute dtype
            self.parts.setdefault(id(p), []).append(xp.array(g, copy=True))   # (ZeRO-3 may have freed p.data)
            return xp.zeros(g.shape, dtype=p.dtype)    # .grad gets 0: the value comes in finish
        keep.elementwise = True                        # also on a deterministic batched pass's stacks
        return keep

    def reset(self):
        self.parts = {}

    def partials(self):
        """(k Σ|p|,) in the compute dtype: every kept partial, micro-batch major; None: none."""
        have = [p for p in self.params if id(p) in self.parts]
        if not have:
            return None
        k = len(self.parts[id(have[0])])
        if any(len(self.parts[id(p)]) != k for p in have):
            raise RuntimeError("sequence parallelism: the partial gradients saw different numbers of "
                               "backward passes in one step")
        self._have, self._k = have, k
        return xp.concatenate([self.parts[id(p)][j].reshape(-1) for j in range(k) for p in have])

    def write(self, flat):
        have, k = self._have, self._k
        lo, sums = 0, {}
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
                s *= 1.0 / k                           # as GradAccumulator: ÷ k, then one rounding
            if p.grad is None:
                p.grad = s.astype(p.dtype).reshape(self.parts[id(p)][0].shape)
            else:
                p.grad[...] = s.astype(p.dtype).reshape(p.grad.shape)
        self.parts = {}


__all__ = ["FullGradAccumulator", "GradAccumulator", "FullPipelineGrads", "PipelineGrads", "FullPartialGrads",
           "PartialGrads"]
