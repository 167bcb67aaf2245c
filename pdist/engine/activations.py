"""Activations, each one Function with a hand-derived backward.

    GELU     y = x/2 (1 + tanh(k (x + 0.044715 x^3)))      GPT-2's tanh approximation
    SwiGLU   y = silu(a) * b = a sigmoid(a) * b            Llama's gated MLP product
"""
import math

from pdist.engine.autograd import Function
from pdist.engine.backend import is_device_array, xp

_GELU_K = math.sqrt(2.0 / math.pi)


BLOCK = 1 << 16  # elements per cache block of GELU on the host (256 KiB of float32 per array)


def _gelu_into(x, y, d, x2):
    """y = GELU(x) and d = dy/dx, written into y and d; x2 is scratch (all of x's shape)."""
    xp.multiply(x, x, out=x2)
    xp.multiply(x2, _GELU_K * 0.044715, out=d)
    d += _GELU_K
    d *= x  # k (x + 0.044715 x^3)
    xp.tanh(d, out=d)  # t
    xp.add(d, 1.0, out=y)
    y *= 0.5  # (1 + t)/2
    x2 *= 0.5 * _GELU_K * 3 * 0.044715
    x2 += 0.5 * _GELU_K
    x2 *= x  # x/2 k (1 + 3 0.044715 x^2)
    d *= d
    xp.subtract(1.0, d, out=d)  # 1 - t^2
    d *= x2
    d += y  # dy/dx
    y *= x  # y = x (1 + t)/2


class GELU(Function):
    """Tanh-approximate GELU (GPT-2): y = x/2 (1 + t), t = tanh(k (x + 0.044715 x^3)),
    k = sqrt(2/pi).  dy/dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 0.044715 x^2).
    Forward computes y and dy/dx together while x^2 and t are at hand (15 passes over
    memory), so backward is one product g dy/dx: 16 passes in all where computing dy/dx
    in backward from x and t took 20. On the host the passes run over blocks of ``BLOCK``
    elements that stay in cache (docs/performance.md); on a device, over the whole array."""
    fresh_grads = True

    def forward(self, x):
        y, d = xp.empty_like(x), xp.empty_like(x)
        n = x.size
        if is_device_array(x) or n <= BLOCK or not x.flags.c_contiguous:
            _gelu_into(x, y, d, xp.empty_like(x))
        else:
            xf, yf, df = x.reshape(-1), y.reshape(-1), d.reshape(-1)  # views
            scratch = xp.empty(BLOCK, dtype=x.dtype)
            for lo in range(0, n, BLOCK):
                hi = min(n, lo + BLOCK)
                _gelu_into(xf[lo:hi], yf[lo:hi], df[lo:hi], scratch[:hi - lo])
        self.dydx = d
        return y

    def backward(self, g):
        d, self.dydx = self.dydx, None  # forward's buffer, needed no more: dx = g dy/dx in place
        d *= g
        return d


class SwiGLU(Function):
    """y = silu(a) * b with silu(a) = a sigmoid(a) (Shazeer, 2020, "GLU Variants Improve
    Transformer"): Llama's MLP is down(silu(x W_gate) * x W_up). With s = sigmoid(a):
    dy/db = a s,  dy/da = b s (1 + a (1 - s)). With e = exp(-|a|) (no overflow), sigmoid(a) is
    1 / (1 + e) for a >= 0 and e / (1 + e) below (full relative precision where s is tiny).
    Forward keeps s; a and b are its inputs (the graph holds them anyway)."""
    fresh_grads = True

    def forward(self, a, b):
        if a.shape != b.shape:
            raise ValueError(f"swiglu: gate {a.shape} and up {b.shape} must have the same shape")
        e = xp.abs(a)
        e *= -1.0
        xp.exp(e, out=e)
        s = xp.where(a >= 0, 1.0, e).astype(a.dtype, copy=False)
        e += 1.0
        s /= e  # sigmoid(a)
        y = a * s
        y *= b
        self.a, self.b, self.s = a, b, s
        return y

    def backward(self, g):
        a, b, s = self.a, self.b, self.s
        na, nb = self.needs_input_grad
        gb = ga = None
        if nb:
            gb = a * s  # silu(a)
            gb *= g
        if na:
            ga = xp.subtract(1.0, s)
            ga *= a
            ga += 1.0
            ga *= s
            ga *= b
            ga *= g  # g b s (1 + a (1 - s))
        self.a = self.b = self.s = None
        return ga, gb


def gelu(x): return GELU.apply(x)
def swiglu(gate, up): return SwiGLU.apply(gate, up)


__all__ = ["GELU", "SwiGLU", "gelu", "swiglu", "BLOCK"]
