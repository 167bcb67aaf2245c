"""Mixed precision: low-precision parameters and gradients, fp32 master weights, and
fp16's dynamic loss scaling (Micikevicius et al., 2018, "Mixed Precision Training";
the ZeRO paper's 16Ψ counts exactly this: Rajbhandari et al., 2020, sec. 3.1).

    precision   param/grad dtype   master, Adam m, v   loss scaling
    "fp32"      float32 (as built)  none (the params)   none
    "bf16"      bfloat16 (ml_dtypes) float32            none (bf16 has fp32's exponent range)
    "fp16"      float16             float32             GradScaler (PyTorch's semantics)

Per parameter: low-precision weight 2 B + gradient 2 B, and the optimizer's fp32
master copy, m and v, 12 B: 16Ψ, the paper's K = 12.

How the arithmetic runs (on CPU; the rounding points, all deterministic):

* a matmul (``nn.Linear``, the tied LM head, the tensor-parallel layers) rounds its
  input activations to the low dtype, upcasts the low-precision weight exactly, and
  multiplies in the compute dtype (the model's activations' dtype, float32; float64 in
  the equivalence tests) through BLAS: bf16 inputs, fp32 products and accumulation, as
  a bf16 GEMM with fp32 accumulate does. The gradients of the weights are rounded to
  their dtype; the gradient of the activations stays in the compute dtype (so a
  tensor-parallel all-reduce of partial dX sums what one process computes whole).
* embeddings, LayerNorm, softmax and the loss run in the compute dtype on the
  upcast weights (autocast's fp32 list).
* a parameter's gradient is rounded to its dtype once per use and backward pass;
  uses of one tensor (the tied ``wte``) are summed in it.
* the gradients' sums are the policy's. ``MixedPrecisionPolicy(param_dtype)`` (after
  FSDP2's) hands each strategy a keeper that rounds where one process rounds
  (pdist/engine/grad_rounding.py): k micro-batches summed in fp32, divided by k and
  rounded once (``policy.accumulator``), exactly as the data-parallel average over N
  ranks is (pdist/comm/low_precision.py), so DP(N) and ZeRO over N ranks equal one
  process with N micro-batches bit for bit; a pipeline stage the same per micro-batch,
  with a tied embedding's two parts summed first (``policy.pipeline_grads``); sequence
  parallelism's partial gradients (LayerNorms, row biases, wpe) leaving backward
  unrounded (``unrounded``) and rounded after their tp all-reduce
  (``policy.partial_grads``). ``FullPrecisionPolicy()``, the fp32 policy, is the twin
  whose keepers round nothing: backward on S l / k, sums in ``.grad``, one all-reduce.
  No strategy asks which dtype it holds: ``Local`` holds the policy (``parallelize``
  and ``MixedPrecision`` hand it in; alone, ``policy_of`` reads the parameters' dtypes
  once), and fp16's loss scale S reaches it as ``compute(x, y, S)``'s argument.
* the optimizer updates the fp32 masters with the upcast (fp16: unscaled) gradient;
  the low-precision weights are the masters rounded, refreshed before the next forward
  (pdist/parallel/mixed_precision.py).

The dtype facts (``bfloat16``, ``is_low``, 2-byte words on the wire) are the backend's
(pdist/engine/backend.py); ``bfloat16`` and ``is_low`` are re-exported here.
"""
import numpy as np

from pdist.engine import functional as F
from pdist.engine.autograd import Function, Tensor
from pdist.engine import backend
from pdist.engine.backend import is_low, to_numpy, xp
from pdist.engine.grad_rounding import (FullGradAccumulator, FullPartialGrads, FullPipelineGrads, GradAccumulator,
                                        PartialGrads, PipelineGrads)
from pdist.engine.index_checks import check_indices

PRECISIONS = ("fp32", "bf16", "fp16")


def low_dtype(precision):
    """The parameters' dtype of a precision name: None for "fp32" (the model's own)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" and backend.bfloat16 is None:  # pragma: no cover
        raise ImportError("precision='bf16' needs the ml_dtypes package (pip install ml_dtypes)")
    return {"fp32": None, "bf16": backend.bfloat16 if precision == "bf16" else None,
            "fp16": np.dtype(np.float16)}[precision]


def cast_module(module, precision):
    """Store every parameter of ``module`` in the low dtype of ``precision`` (in place);
    each remembers the dtype it computes in (``p.compute_dtype``, its old dtype)."""
    dt = low_dtype(precision)
    if dt is None:
        return module
    for _, p in module.named_parameters():
        if not is_low(p.dtype):
            p.compute_dtype = p.dtype
            p.data = p.data.astype(dt)
    return module


def _compute_dtype(p):
    return getattr(p, "compute_dtype", None) or np.float32


class Cast(Function):
    """y = x in ``dtype``; dx = g in x's dtype (a low-precision parameter's gradient
    is rounded to it here), or in g's own dtype with ``keep`` (``unrounded``)."""
    param_view = True     # an upcast weight is a weight (split backward, backprop.py)

    def forward(self, x, dtype, keep=False):
        self.src, self.keep = x.dtype, keep
        return x.astype(dtype)

    def backward(self, g):
        return g if self.keep else g.astype(self.src)


def unrounded(p):
    """True when ``p``'s gradient leaves backward in the compute dtype, unrounded: a
    sequence-parallel partial sum that is rounded after its tp all-reduce (grad_rounding.py)."""
    return bool(getattr(p, "unrounded_grad", False))


def weight(p):
    """Parameter ``p`` in its compute dtype (differentiably), or ``p`` itself."""
    if p is None or not is_low(p.dtype):
        return p
    return Cast.apply(p, dtype=_compute_dtype(p), keep=unrounded(p))


def _round(a, low):
    return a.astype(low).astype(a.dtype)


class LowLinear(F.Linear):
    """Y = round(X) W + b, with W, b low-precision and upcast, X rounded to W's dtype;
    dX = G W^T (compute dtype), dW = round(round(X)^T G), db = round(sum G) (rounded to
    the parameters' dtype). ``F.Linear`` with its three hooks filled in: W is read again
    at backward (ZeRO-3 may have re-gathered it); no upcast copy of W outlives the op."""
    def _input(self, x2, w):
        self._low = w.dtype
        return _round(x2, w.dtype)                                                         # (N, in)

    def _param(self, p, dtype):
        return p.astype(dtype)

    def _grad(self, g, p):
        return g.astype(p.dtype)

    def _mm(self, a, b):
        """On a device: one bf16/fp16 GEMM (tensor cores, fp32 accumulate and result; G rounded
        to the low dtype, as autocast does). On the host: ``a @ b`` in the compute dtype."""
        if backend.is_device_array(a):
            from pdist.engine.attention_device import low_matmul
            return low_matmul(a, b, self._low).astype(a.dtype, copy=False)
        return a @ b


class LowEmbedding(Function):
    """y = upcast(W)[idx]; dW = round(scatter-add of g at idx), summed in the compute dtype."""
    def forward(self, w, idx, dtype, keep=False):
        check_indices(idx, w.shape[0], "embedding index")
        self.idx, self.wshape, self.wdtype, self.keep = idx, w.shape, w.dtype, keep
        return w[idx].astype(dtype)

    def backward(self, g):
        gw = F.embedding_grad(self.wshape, g.dtype, self.idx, g)                           # (V, C)
        return (gw if self.keep else gw.astype(self.wdtype)), None


def linear(x, w, b=None, layout="in_out"):
    """``F.linear`` (W (in, out), or (out, in) with ``layout="out_in"``), in mixed precision
    when ``w`` is low-precision (LowLinear: the same rounding points in both layouts)."""
    if not is_low(w.dtype):
        return F.linear(x, w, b, layout)
    F.check_weight_layout(layout)
    return (LowLinear.apply(x, w, b, layout=layout) if b is not None
            else LowLinear.apply(x, w, layout=layout))


def embedding(idx, w):
    """``F.embedding`` in mixed precision when ``w`` is low-precision (LowEmbedding)."""
    if not is_low(w.dtype):
        return F.embedding(idx, w)
    idx = idx.data if isinstance(idx, Tensor) else idx
    return LowEmbedding.apply(w, xp.asarray(idx), dtype=_compute_dtype(w), keep=unrounded(w))


class FullPrecisionPolicy:
    """The fp32 policy: parameters and gradients in the model's own dtype, and every
    keeper the fp32 code itself (pdist/engine/grad_rounding.py): backward on S l / k,
    sums in ``.grad``, one all-reduce. The twin of ``MixedPrecisionPolicy``, whose
    rounding it leaves out; what a strategy gets when nothing says otherwise."""

    param_dtype = None        # the model's dtype (FSDP2: param_dtype=None, no cast)
    precision = "fp32"

    def late_grads(self, microbatches):
        """True when k = ``microbatches`` backwards leave the gradients incomplete until the
        last (DDP and ZeRO then reduce after backward instead of overlapping it)."""
        return False

    def accumulator(self, params, microbatches):
        """The keeper of ``Local.compute``'s micro-batch loop: ``backward_scale(S)``, the factor
        of each micro-batch loss; ``add()`` after each backward; ``finish()`` after the last."""
        return FullGradAccumulator(microbatches)

    def partial_grads(self, params):
        """The keeper of sequence parallelism's partial gradients of ``params``: ``reset()`` at
        zero_grad; ``partials()`` the flat buffer tensor parallelism all-reduces, ``write(flat)``
        the sum, in finish_grad_sync."""
        return FullPartialGrads(params)

    def pipeline_grads(self, params, tied, ends, microbatches, local_tied=()):
        """A pipeline stage's keeper: ``backward_scale(S)``, ``after_backward(k, mb)`` after each
        BACKWARD (or W) of micro-batch mb at virtual stage k, ``finish()`` when the schedule
        ends, ``tied_parts()`` / ``set_tied(summed)`` around the pipeline's all-reduce of the
        tied copies ``tied`` used by the virtual stages ``ends``; ``local_tied``: tied weights
        both of whose ends are on this rank."""
        return FullPipelineGrads(tied, microbatches)

    def __eq__(self, other):
        return isinstance(other, FullPrecisionPolicy) and self.param_dtype == other.param_dtype

    def __hash__(self):
        return hash(self.precision)

    def __repr__(self):
        return f"{type(self).__name__}({'' if self.param_dtype is None else f'param_dtype={self.precision}'})"


class MixedPrecisionPolicy(FullPrecisionPolicy):
    """``MixedPrecisionPolicy(param_dtype=bfloat16)`` (or float16), after FSDP2's: the
    parameters and their gradients in ``param_dtype``, the activations in the compute
    dtype, the gradients' sums (micro-batches, ranks, sequence shards, a tied embedding) in
    fp32 and rounded once, where one process rounds (the module docstring)."""

    def __init__(self, param_dtype="bfloat16"):
        if isinstance(param_dtype, str) and param_dtype == "bfloat16":
            param_dtype = backend.bfloat16        # ml_dtypes, imported on first use
        dt = np.dtype(param_dtype) if param_dtype is not None else None
        if dt is None or not is_low(dt):
            raise ValueError(f"MixedPrecisionPolicy(param_dtype={param_dtype!r}): param_dtype must be bfloat16 "
                             "or float16; the fp32 policy is FullPrecisionPolicy()")
        self.param_dtype, self.precision = dt, "fp16" if dt == np.float16 else "bf16"

    def late_grads(self, microbatches):
        return microbatches > 1            # the rounded mean is written after the last micro-batch

    def accumulator(self, params, microbatches):
        if microbatches == 1:              # one backward: its gradient is rounded once already
            return FullGradAccumulator(1)
        return GradAccumulator(params, microbatches)

    def partial_grads(self, params):
        return PartialGrads(params)

    def pipeline_grads(self, params, tied, ends, microbatches, local_tied=()):
        return PipelineGrads(params, tied, ends, microbatches, local_tied)


FULL_PRECISION = FullPrecisionPolicy()


def policy_for(precision):
    """The policy of a precision name: "fp32", "bf16" or "fp16"."""
    dt = low_dtype(precision)
    return FULL_PRECISION if dt is None else MixedPrecisionPolicy(dt)


def policy_of(params):
    """The policy the dtypes of ``params`` say (read once, where a strategy is built):
    mixed when a parameter is bfloat16 or float16 (``cast_module``), else fp32."""
    low = next((p.dtype for p in params if is_low(p.dtype)), None)
    return FULL_PRECISION if low is None else MixedPrecisionPolicy(low)


def any_nonfinite(arrays):
    """True when any array holds inf or NaN (one stacked check, one host read)."""
    checks = [xp.isfinite(a).all() for a in arrays if a is not None and a.size]
    return bool(checks) and not bool(to_numpy(xp.stack(checks).all()))


# bfloat16 comes from __getattr__ below (ml_dtypes imported on first use)
__all__ = ["PRECISIONS", "bfloat16", "low_dtype", "is_low", "cast_module", "weight", "unrounded", "linear",  # noqa: F822
           "embedding", "FullPrecisionPolicy", "MixedPrecisionPolicy", "FULL_PRECISION", "policy_for", "policy_of",
           "GradAccumulator", "any_nonfinite"]


def __getattr__(name):
    """``precision.bfloat16``: the backend's, made on first access (PEP 562)."""
    if name == "bfloat16":
        return backend.bfloat16
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
