"""Activation recomputation (Chen et al., 2016, "Training Deep Nets with Sublinear Memory
Cost"; Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
Models"), in the sense of ``torch.utils.checkpoint.checkpoint``.

    y = checkpoint(fn, *inputs)

Forward runs ``fn(*inputs)`` under ``no_grad``: no graph, so none of fn's intermediate
arrays stay alive; the node keeps only the input tensors (and, with
``preserve_rng_state``, the state of every generator fn may draw from). Backward runs fn
again on detached copies of the inputs, this time recording the graph, backpropagates
dL/dy through it, and hands dL/dinputs on to the outer graph:

    memory  : fn's activations are held for one fn at a time, during its backward
    compute : one extra forward of fn per step (about +1/3 of the step's FLOPs for "full")

Parameters fn reads (leaves such as a Module's weights) need not be passed as inputs:
the inner backward accumulates into their ``.grad`` and fires their hooks exactly once
per backward, as the ordinary graph would (DDP's bucket readiness, ZeRO's reductions).
Inside a split backward (``defer_weights=True``, split_backward.py) the inner backward is split
too: B recomputes fn and computes dL/dinputs; the inner weight gradients wait for W (the
recomputed activations they need are held until then).
Every other tensor fn depends on must be passed in ``inputs``: a captured tensor with a
graph would be backpropagated by the inner backward and then lose its graph.

Randomness: a ``Dropout`` module draws its mask from its own generator (nn.Dropout). With
``preserve_rng_state=True`` (PyTorch's default) and fn a Module, the state of every
Dropout generator in it is saved before forward, restored for the recompute, and put
back afterwards, so the recomputed forward draws the same masks and later draws are
unchanged.
"""
import copy

from pdist.engine.autograd import Function, Tensor, is_grad_enabled, no_grad
from pdist.engine import hooks
from pdist.engine.backprop import run_backward
from pdist.engine.split_backward import current_split, run_backward_input

MODES = ("none", "selective", "full")


def check_mode(mode):
    """Megatron's --recompute-granularity: 'none', 'selective' (core attention) or 'full' (the block)."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    return mode


def _generators(fn):
    """The generators of the Dropout modules in fn (a Module, or a bound method of one)."""
    owner = getattr(fn, "__self__", fn)
    modules = owner.modules() if hasattr(owner, "modules") else []
    return [m.rng for m in modules if hasattr(getattr(m, "rng", None), "bit_generator")]


class _Checkpoint(Function):
    """One checkpointed call. Saved: the inputs (``parents``, or ``self.others`` for
    non-tensors), fn, and the generators' states; nothing fn computed."""

    def run(self, fn, inputs, preserve_rng_state):
        self.fn = fn
        self.others = [None if isinstance(x, Tensor) else x for x in inputs]
        gens = _generators(fn) if preserve_rng_state else []
        self.rng = [(g, copy.deepcopy(g.bit_generator.state)) for g in gens]
        with no_grad():
            out = fn(*inputs)
        if not isinstance(out, Tensor):
            raise TypeError(f"checkpoint: fn must return one Tensor, got {type(out).__name__}")
        return out.data

    def backward(self, g):
        ins = [Tensor._make(p.data, need) if p is not None else o     # detached: the graph starts here
               for p, o, need in zip(self.parents, self.others, self.needs_input_grad)]
        after = [(gen, copy.deepcopy(gen.bit_generator.state)) for gen, _ in self.rng]
        for gen, state in self.rng:
            gen.bit_generator.state = state                    # the masks forward drew
        try:
            with hooks.span("recompute"):                      # the instruments' span (engine/hooks.py)
                out = self.fn(*ins)                            # the recomputed forward, with its graph
        finally:
            for gen, state in after:
                gen.bit_generator.state = state
        split = current_split()
        if out.requires_grad and split is None:
            run_backward(out, g)                               # params: .grad and hooks; ins: .grad
        elif out.requires_grad:                                # inside a split backward: B now, W with it
            leaves = [x for x, need in zip(ins, self.needs_input_grad) if need]
            split.join(run_backward_input(out, g, leaves))
        return tuple(x.grad if need else None for x, need in zip(ins, self.needs_input_grad))


def checkpoint(fn, *inputs, preserve_rng_state=True):
    """y = fn(*inputs) keeping only the inputs; fn runs again in backward (module docstring).
    Outside grad mode it is fn(*inputs). The output requires grad (fn may read parameters)."""
    if not is_grad_enabled():
        return fn(*inputs)
    node = _Checkpoint()
    node.parents = tuple(x if isinstance(x, Tensor) else None for x in inputs)
    node.needs_input_grad = tuple(isinstance(x, Tensor) and x.requires_grad for x in inputs)
    t = Tensor._make(node.run(fn, inputs, preserve_rng_state), True)
    t._ctx = node
    return t
