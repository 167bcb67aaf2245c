"""Normalizations over the last axis, each one Function with a fused backward.

    LayerNorm   y = (x - mean) / sqrt(var + eps) * w + b       GPT-2 (Ba et al., 2016)
    RMSNorm     y = x / sqrt(mean(x^2) + eps) * w              Llama (Zhang & Sennrich, 2019)

Both keep x_hat and 1/sigma per row and reuse them in backward. Under mixed precision
the weights come in upcast (``precision.weight``) and the norm runs in the compute dtype.
The weights' gradients sum over the tokens (the rows) in ``_sum_rows``, one gemv each; a
subclass may sum them in another order.
"""
from pdist.engine.autograd import Function
from pdist.engine.backend import xp
from pdist.engine.reductions import col_sums, row_dots, row_sums


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis (Ba et al., 2016).
    Fused backward with xhat = (x - mean) * rstd, dxhat = g w:
    dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dw = sum g xhat, db = sum g."""
    fresh_grads = True

    def forward(self, x, w, b, eps=1e-5):
        C = x.shape[-1]
        x2 = x.reshape(-1, C)  # (N, C)
        mean = row_sums(x2)
        mean /= C
        xc = x2 - mean  # (N, C)
        var = row_dots(xc, xc)  # (N, 1)
        var /= C
        var += eps
        rstd = 1.0 / xp.sqrt(var, out=var)  # (N, 1)
        xc *= rstd  # xhat
        self.xhat, self.rstd, self.shape = xc, rstd, x.shape
        y = xc * w
        y += b
        return y.reshape(x.shape)

    def backward(self, g):
        # With dxhat = g w (per row):  mean(dxhat) = (g @ w) / C and
        # mean(dxhat xhat) = ((g xhat) @ w) / C, and g xhat is also what dw sums,
        # so the row means come from two matrix-vector products.
        w = self.parents[1].data
        xhat, rstd = self.xhat, self.rstd  # (N, C), (N, 1)
        nx, nw, nb = self.needs_input_grad
        C = xhat.shape[1]
        g2 = g.reshape(xhat.shape)  # (N, C)
        gx = gw = gb = None
        gxh = g2 * xhat  # (N, C)
        if nw:
            gw = self._sum_rows(gxh)  # (C,)
        if nb:
            gb = self._sum_rows(g2)
        if nx:
            a = (g2 @ w)[:, None] / C  # mean(dxhat), (N, 1)
            c = (gxh @ w)[:, None] / C  # mean(dxhat xhat), (N, 1)
            gx = xp.multiply(g2, w, out=gxh)  # dxhat, in g xhat's buffer (summed already)
            gx -= a
            xhat *= c  # forward's x_hat is needed no more: reuse it
            gx -= xhat
            gx *= rstd
            gx = gx.reshape(self.shape)
        self.xhat = None
        return gx, gw, gb

    def _sum_rows(self, a2):
        return col_sums(a2)  # 1^T a2: (N, C) -> (C,)


class RMSNorm(Function):
    """y = x r w with r = 1 / sqrt(mean(x^2) + eps) over the last axis (Zhang & Sennrich, 2019,
    "Root Mean Square Layer Normalization"; Hugging Face's LlamaRMSNorm). With xhat = x r and
    dxhat = g w (per row): dx = r (dxhat - xhat mean(dxhat xhat)), dw = sum g xhat."""
    fresh_grads = True

    def forward(self, x, w, eps=1e-6):
        C = x.shape[-1]
        x2 = x.reshape(-1, C)  # (N, C)
        ms = row_dots(x2, x2)  # (N, 1)
        ms /= C
        ms += eps
        rstd = 1.0 / xp.sqrt(ms, out=ms)  # (N, 1)
        xhat = x2 * rstd  # (N, C)
        self.xhat, self.rstd, self.shape = xhat, rstd, x.shape
        return (xhat * w).reshape(x.shape)

    def backward(self, g):
        # mean(dxhat xhat) = ((g xhat) @ w) / C, and g xhat is what dw sums (as LayerNorm)
        w = self.parents[1].data
        xhat, rstd = self.xhat, self.rstd  # (N, C), (N, 1)
        nx, nw = self.needs_input_grad[:2]
        g2 = g.reshape(xhat.shape)  # (N, C)
        gxh = g2 * xhat  # (N, C)
        gw = self._sum_rows(gxh) if nw else None  # (C,)
        gx = None
        if nx:
            c = (gxh @ w)[:, None] / xhat.shape[1]  # mean(dxhat xhat), (N, 1)
            gx = xp.multiply(g2, w, out=gxh)  # dxhat, in g xhat's buffer (summed already)
            xhat *= c  # forward's x_hat is needed no more: reuse it
            gx -= xhat
            gx *= rstd
            gx = gx.reshape(self.shape)
        self.xhat = None
        return gx, gw

    def _sum_rows(self, a2):
        return col_sums(a2)  # 1^T a2: (N, C) -> (C,)


def layer_norm(x, weight, bias, eps=1e-5):
    return LayerNorm.apply(x, weight, bias, eps=eps)


def rms_norm(x, weight, eps=1e-6):
    return RMSNorm.apply(x, weight, eps=eps)


__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]
