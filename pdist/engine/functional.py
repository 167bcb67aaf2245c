"""Fused neural-network ops, each one Function with a hand-derived backward
that reuses forward's values (no recomputation, no graph of small ops).

Available as ``pdist.nn.functional``: linear, softmax, log_softmax, embedding, dropout,
scaled_causal_softmax, cross_entropy, mse_loss, and from their own files gelu, swiglu
(activations.py), layer_norm, rms_norm (norms.py) and apply_rotary (rope.py).
"""
from pdist.engine.autograd import Function, Tensor
from pdist.engine.backend import array_module, scatter_add, xp
from pdist.engine.index_checks import check_indices
from pdist.engine.activations import GELU, SwiGLU, gelu, swiglu  # noqa: F401  (re-exported)
from pdist.engine.norms import LayerNorm, RMSNorm, layer_norm, rms_norm  # noqa: F401
from pdist.engine.reductions import col_sums, row_dots, row_sums  # noqa: F401
from pdist.engine.rope import apply_rotary  # noqa: F401


class Linear(Function):
    """Y = X W + b with W stored (in, out) (``layout="in_out"``, GPT-2's Conv1D), or
    Y = X W^T + b with W stored (out, in) (``layout="out_in"``, PyTorch's and HF Llama's).
    in_out: dX = G W^T, dW = X^T G;  out_in: dX = G W, dW = G^T X  (over all leading axes);
    db = sum G. Either way one GEMM per product, W read through a transposed view, no copy.

    Leading axes are folded into one, so each product is a single 2-D GEMM
    (N, in) x (in, out) with N = prod(leading axes): NumPy would otherwise run one
    small GEMM per leading index (measured 2x slower at the lesson size).

    Three hooks, identities here, let a mixed-precision subclass (pdist.engine.precision.LowLinear)
    round the input it keeps, compute with its parameters in the compute dtype, and round
    the parameters' gradients back to their own dtype: ``_input``, ``_param``, ``_grad``;
    ``_mm`` (``a @ b`` here) lets it run the three products as bf16/fp16 GEMMs on a device.
    ``_rows`` (the leading axes folded into one) and ``_sum_rows`` (db, one gemv) let a
    subclass cut the rows into independent groups, each its own GEMM and sum.
    ``split_backward``: a split backward asks for dX (B) and for dW, db (W) in two calls."""
    fresh_grads = True
    split_backward = True

    def forward(self, x, w, b=None, layout="in_out"):
        self.out_in = out_in = layout == "out_in"
        n_in = w.shape[1] if out_in else w.shape[0]
        if x.shape[-1] != n_in:
            raise ValueError(f"linear: input has {x.shape[-1]} features but the weight is {w.shape} "
                             f"(layout {layout!r}: in_features={n_in})")
        x2 = self._rows(x)                     # (N, in)
        self.x2, self.lead = self._input(x2, w), x.shape[:-1]
        wc = self._param(w, x.dtype)
        y = self._mm(self.x2, wc.T if out_in else wc)  # (N, out)
        if b is not None:
            y += self._param(b, x.dtype)
        return y.reshape(*self.lead, w.shape[0] if out_in else w.shape[1])

    def backward(self, g):
        w, out_in = self.parents[1].data, self.out_in
        nx, nw = self.needs_input_grad[:2]
        nb = len(self.needs_input_grad) > 2 and self.needs_input_grad[2]
        g2 = self._rows(g)               # (N, out)
        gx = gw = None
        if nx:
            wc = self._param(w, g.dtype)
            gx = self._mm(g2, wc if out_in else wc.T).reshape(*self.lead, self.x2.shape[-1])
        if nw:   # (out, in) / (in, out)
            gw = self._grad(self._mm(xp.swapaxes(g2, -1, -2), self.x2) if out_in
                            else self._mm(xp.swapaxes(self.x2, -1, -2), g2), w)
        gb = self._grad(self._sum_rows(g2), w) if nb else None
        return gx, gw, gb

    def _rows(self, a):
        return a.reshape(-1, a.shape[-1])      # (..., K) -> (N, K): one GEMM over all N rows

    def _sum_rows(self, a2):
        return col_sums(a2)                    # 1^T a2: (N, K) -> (K,)

    def _input(self, x2, w):
        return x2

    def _param(self, p, dtype):
        return p

    def _grad(self, g, p):
        return g

    def _mm(self, a, b):
        return a @ b


class Softmax(Function):
    """y = exp(x - max) / sum exp(x - max);  dx = y (g - sum(g y))"""
    def forward(self, x, axis=-1):
        self.axis = axis
        e = xp.exp(x - x.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        self.y = e
        return e

    def backward(self, g):
        y = self.y
        d = g - (g * y).sum(axis=self.axis, keepdims=True)
        d *= y
        return d


class LogSoftmax(Function):
    """y = x - logsumexp(x);  dx = g - softmax(x) sum(g)"""
    def forward(self, x, axis=-1):
        self.axis = axis
        s = x - x.max(axis=axis, keepdims=True)
        self.y = s - xp.log(xp.exp(s).sum(axis=axis, keepdims=True))
        return self.y

    def backward(self, g):
        return g - xp.exp(self.y) * g.sum(axis=self.axis, keepdims=True)


_causal_masks = {}


def causal_mask(T, S, dtype):
    """The additive mask M (T, S): 0 where key j <= query i + (S - T), -inf above.
    Cached per (T, S, dtype, device), so a step builds none."""
    from pdist.engine.backend import device
    key = (T, S, str(dtype), device())
    m = _causal_masks.get(key)
    if m is None:
        if len(_causal_masks) > 32:
            _causal_masks.clear()
        above = xp.triu(xp.ones((T, S), dtype=bool), k=S - T + 1)  # (T, S) future keys
        m = _causal_masks[key] = xp.where(above, -xp.inf, 0.0).astype(dtype)
    return m


class ScaledCausalSoftmax(Function):
    """y = softmax(scale * x + M) over the last axis, M_ij = -inf for j > i (+ the
    key offset for rectangular blocks). Megatron's fused
    ``ScaledUpperTriangMaskedSoftmax``: scale, mask and softmax in one pass.
    dx = scale * y * (g - sum(g y))."""
    def forward(self, x, scale=1.0):
        z = x * scale
        z += causal_mask(x.shape[-2], x.shape[-1], x.dtype)  # M broadcast over (B, nh)
        z -= z.max(axis=-1, keepdims=True)
        xp.exp(z, out=z)
        z /= row_sums(z)
        self.y, self.scale = z, scale
        return z

    def backward(self, g):
        y = self.y
        d = g - row_dots(g, y)
        d *= y
        d *= self.scale
        return d


class Embedding(Function):
    """y = W[idx]; dW = scatter-add of g at the rows idx (repeated rows add)."""
    fresh_grads = True

    def forward(self, w, idx):
        check_indices(idx, w.shape[0], "embedding index")
        self.idx, self.wshape = idx, w.shape
        return w[idx]

    def backward(self, g):
        return embedding_grad(self.wshape, g.dtype, self.idx, g), None


def embedding_grad(wshape, dtype, idx, g):
    """dW of y = W[idx]: zeros of ``wshape`` with g (..., C) scatter-added at the rows idx (...)."""
    gw = xp.zeros(wshape, dtype=dtype)                                              # (V, C)
    scatter_add(gw, idx.reshape(-1), g.reshape(-1, wshape[1]))
    return gw


class Dropout(Function):
    """y = x * m / (1 - p), m ~ Bernoulli(1 - p) from the given generator. The mask is
    drawn on the host (NumPy's generator) and moved to x's device, so a CPU and a GPU run
    with the same seed drop the same units (CuPy's generator draws other numbers)."""
    def forward(self, x, p, rng):
        self.m = array_module(x).asarray((rng.random(x.shape) >= p).astype(x.dtype) / (1.0 - p))
        return x * self.m

    def backward(self, g):
        return g * self.m


class CrossEntropy(Function):
    """loss = mean over counted rows of (logsumexp(z) - z[target]) (numerically
    stable: z is shifted by its row max). dz = (softmax(z) - onehot(target)) / count,
    zero on rows whose target == ignore_index."""
    def forward(self, logits, targets, ignore_index=None):
        V = logits.shape[-1]
        z = logits.reshape(-1, V)  # (N, V)
        t = targets.reshape(-1)  # (N,)
        if t.shape[0] != z.shape[0]:
            raise ValueError(f"cross_entropy: {z.shape[0]} rows of logits but {t.shape[0]} targets "
                             f"(logits {logits.shape}, targets {targets.shape})")
        keep = None if ignore_index is None else (t != ignore_index)
        tt = t if keep is None else xp.where(keep, t, 0)
        check_indices(tt, V, "cross_entropy target")
        s = z - z.max(axis=1, keepdims=True)
        e = xp.exp(s)
        se = row_sums(e)
        rows = xp.arange(z.shape[0])
        nll = xp.log(se[:, 0]) - s[rows, tt]  # (N,)
        count = z.shape[0] if keep is None else int(keep.sum())
        if keep is not None:
            nll = nll * keep
        self.p, self.tt, self.rows, self.keep = e / se, tt, rows, keep
        self.count, self.shape = max(count, 1), logits.shape
        return self._mean(nll, logits.dtype)

    def _mean(self, nll, dtype):
        return xp.asarray(nll.sum() / self.count, dtype=dtype)    # the mean over the counted rows

    def backward(self, g):
        d = self.p  # reuse forward's buffer: softmax -> gradient, in place
        d[self.rows, self.tt] -= 1.0
        if self.keep is not None:
            d *= self.keep[:, None]
        self._scale(d, g)
        return d.reshape(self.shape), None

    def _scale(self, d, g):
        d *= g / self.count                    # dL/dz = g (softmax - onehot) / count


LAYOUTS = ("in_out", "out_in")


def check_weight_layout(layout):
    """A Linear weight layout: "in_out" (W (in, out), y = x W) or "out_in" (W (out, in), y = x W^T)."""
    if layout not in LAYOUTS:
        raise ValueError(f"linear layout must be one of {LAYOUTS} (W stored (in, out) or (out, in)), "
                         f"got {layout!r}")
    return layout


def linear(x, weight, bias=None, layout="in_out"):
    """y = x W + b (``layout="in_out"``, W (in, out)) or x W^T + b (``"out_in"``, W (out, in))."""
    check_weight_layout(layout)
    return (Linear.apply(x, weight, bias, layout=layout) if bias is not None
            else Linear.apply(x, weight, layout=layout))


def softmax(x, axis=-1): return Softmax.apply(x, axis=axis)
def log_softmax(x, axis=-1): return LogSoftmax.apply(x, axis=axis)
def scaled_causal_softmax(x, scale=1.0): return ScaledCausalSoftmax.apply(x, scale=scale)


def embedding(idx, weight):
    """Rows of weight (V, C) at integer positions idx (...) -> (..., C)."""
    if isinstance(idx, Tensor):
        idx = idx.data
    return Embedding.apply(weight, xp.asarray(idx))


def dropout(x, p=0.0, training=True, rng=None):
    """Inverted dropout; the identity when p == 0 or not training. ``rng`` is an
    ``xp.random.Generator`` (seeded by the caller, so runs are reproducible)."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if rng is None:
        raise ValueError("dropout needs an explicit rng (xp.random.default_rng(seed)) to stay reproducible")
    return Dropout.apply(x, p, rng)


def cross_entropy(logits, targets, ignore_index=None):
    """Mean token cross-entropy. logits (..., V) Tensor, targets (...) int array."""
    if isinstance(targets, Tensor):
        targets = targets.data
    return CrossEntropy.apply(logits, xp.asarray(targets), ignore_index=ignore_index)


def mse_loss(pred, target):
    """mean((pred - target)^2)"""
    d = pred - target
    return (d * d).mean()


__all__ = ["linear", "softmax", "log_softmax", "gelu", "swiglu", "scaled_causal_softmax", "layer_norm",
           "rms_norm", "apply_rotary", "embedding", "dropout", "cross_entropy", "mse_loss"]
