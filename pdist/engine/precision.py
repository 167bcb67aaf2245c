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
* k micro-batches: each backward runs on its micro-batch's mean loss (no 1/k there);
  their gradients are summed in fp32, divided by k and rounded once
  (``GradAccumulator``), exactly as the data-parallel average over N ranks is
  (pdist/comm/low_precision.py: sum in fp32 in rank order, ÷ N, one rounding). So
  DP(N) and ZeRO over N ranks equal one process with N micro-batches bit for bit:
  rank r and micro-batch r compute the same rounded gradient from the same rows.
* a pipeline stage does the same per micro-batch (pdist/parallel/pipeline/grads.py);
  sequence parallelism's partial gradients (LayerNorms, row biases, wpe) leave backward
  unrounded (``unrounded``) and are rounded after their tp all-reduce
  (pdist/parallel/tensor/partial_grads.py), where one process rounds the whole sum.
* the optimizer updates the fp32 masters with the upcast (fp16: unscaled) gradient;
  the low-precision weights are the masters rounded, refreshed before the next forward
  (pdist/parallel/mixed_precision.py).
"""
import numpy as np

from pdist.engine import functional as F
from pdist.engine.autograd import Function, Tensor
from pdist.engine.backend import scatter_add, to_numpy, xp
from pdist.engine.index_checks import check_indices

try:
    import ml_dtypes
    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is an install requirement
    bfloat16 = None

PRECISIONS = ("fp32", "bf16", "fp16")


def low_dtype(precision):
    """The parameters' dtype of a precision name: None for "fp32" (the model's own)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" and bfloat16 is None:  # pragma: no cover
        raise ImportError("precision='bf16' needs the ml_dtypes package (pip install ml_dtypes)")
    return {"fp32": None, "bf16": bfloat16, "fp16": np.dtype(np.float16)}[precision]


_LOW = tuple(d for d in (bfloat16, np.dtype(np.float16)) if d is not None)


def is_low(dtype):
    """True for the 2-byte floating dtypes (bfloat16, float16)."""
    return dtype in _LOW


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
    def forward(self, x, dtype, keep=False):
        self.src, self.keep = x.dtype, keep
        return x.astype(dtype)

    def backward(self, g):
        return g if self.keep else g.astype(self.src)


def unrounded(p):
    """True when ``p``'s gradient leaves backward in the compute dtype, unrounded: a
    sequence-parallel partial sum that is rounded after its tp all-reduce (partial_grads.py)."""
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
        return _round(x2, w.dtype)                                                         # (N, in)

    def _param(self, p, dtype):
        return p.astype(dtype)

    def _grad(self, g, p):
        return g.astype(p.dtype)


class LowEmbedding(Function):
    """y = upcast(W)[idx]; dW = round(scatter-add of g at idx), summed in the compute dtype."""
    def forward(self, w, idx, dtype, keep=False):
        check_indices(idx, w.shape[0], "embedding index")
        self.idx, self.wshape, self.wdtype, self.keep = idx, w.shape, w.dtype, keep
        return w[idx].astype(dtype)

    def backward(self, g):
        gw = xp.zeros(self.wshape, dtype=g.dtype)                                          # (V, C)
        scatter_add(gw, self.idx.reshape(-1), g.reshape(-1, self.wshape[1]))
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


class GradAccumulator:
    """Micro-batch gradients averaged in fp32, rounded once: after each backward pass
    ``add()`` moves every low-precision ``.grad`` into an fp32 sum (zeroing it in place,
    so views into flat buffers stay views); ``finish(1/k)`` writes round(sum / k) back.
    Transient: 4 bytes per parameter during the step (Megatron's fp32 main_grad)."""

    def __init__(self, params):
        self.params = [p for p in params if is_low(p.dtype)]
        self.sums = {}

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

    def finish(self, factor=1.0):
        for p in self.params:
            s = self.sums.get(id(p))
            if s is not None:
                s *= factor                                   # 1/k: the mean, before the one rounding
                p.grad[...] = s.astype(p.dtype)
        self.sums = {}


def any_nonfinite(arrays):
    """True when any array holds inf or NaN (one stacked check, one host read)."""
    checks = [xp.isfinite(a).all() for a in arrays if a is not None and a.size]
    return bool(checks) and not bool(to_numpy(xp.stack(checks).all()))


__all__ = ["PRECISIONS", "bfloat16", "low_dtype", "is_low", "cast_module", "weight", "unrounded", "linear",
           "embedding", "GradAccumulator", "any_nonfinite"]
