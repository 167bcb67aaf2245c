"""Rotary position embeddings (Su et al., 2021, "RoFormer"), in Hugging Face Llama's
convention (``LlamaRotaryEmbedding``, ``rotate_half``).

A head vector x of even size d at position t is rotated pairwise: for i in [0, d/2),
with inv_freq_i = theta^(-2i/d) and the angle a = t inv_freq_i,

    y_i       = x_i cos a - x_{i+d/2} sin a          (the first half)
    y_{i+d/2} = x_{i+d/2} cos a + x_i sin a          (the second half)

so the query-key product q_t . k_u depends on t - u only. Each pair (i, i + d/2) turns by
a, so backward turns the gradient back by -a:

    dx_i = g_i cos a + g_{i+d/2} sin a,   dx_{i+d/2} = g_{i+d/2} cos a - g_i sin a

Positions are 0..T-1 of the sequence the attention sees (always the whole sequence:
under sequence parallelism the projections gather it first), or, under context
parallelism, the global positions of this rank's tokens (``positions``). The tables are computed
in float64 on the host, rounded once to the activations' dtype, and cached.
"""
import numpy as np

from pdist.engine.autograd import Function
from pdist.engine.backend import xp

_tables = {}


def rope_tables(T, head_dim, theta, dtype):
    """cos, sin of t inv_freq_i: two (T, head_dim / 2) arrays, inv_freq_i = theta^(-2i/d)."""
    from pdist.engine.backend import device
    key = (T, head_dim, float(theta), str(dtype), device())
    cs = _tables.get(key)
    if cs is None:
        if len(_tables) > 32:
            _tables.clear()
        inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        angle = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]  # (T, d/2)
        cs = _tables[key] = (xp.asarray(np.cos(angle), dtype=dtype), xp.asarray(np.sin(angle), dtype=dtype))
    return cs


def _turn(x, c, s, head_dim, sign):
    """x (..., T, n d) with each head's pairs (i, i + d/2) turned by +a (sign 1) or -a (sign -1)."""
    x4 = x.reshape(*x.shape[:-1], -1, head_dim)  # (..., T, n, d), a view
    h = head_dim // 2
    c3, s3 = c[:, None, :], s[:, None, :]  # (T, 1, d/2): every head, every row of the batch
    x1, x2 = x4[..., :h], x4[..., h:]
    y = xp.empty(x4.shape, dtype=x.dtype)
    y1, y2 = y[..., :h], y[..., h:]
    xp.multiply(x1, c3, out=y1)
    xp.multiply(x2, c3, out=y2)
    if sign > 0:
        y1 -= x2 * s3
        y2 += x1 * s3
    else:
        y1 += x2 * s3
        y2 -= x1 * s3
    return y.reshape(x.shape)


class Rotary(Function):
    """y = RoPE(x) for x (B, T, n_heads head_dim); see the module docstring for both directions."""
    fresh_grads = True

    def forward(self, x, head_dim, theta, positions=None):
        if head_dim % 2 or x.shape[-1] % head_dim:
            raise ValueError(f"rotary embedding: head_dim {head_dim} must be even and divide the width "
                             f"{x.shape[-1]} of the input {x.shape}")
        if x.ndim < 2:
            raise ValueError(f"rotary embedding: input {x.shape} needs a sequence axis (..., T, width)")
        if positions is None:
            self.c, self.s = rope_tables(x.shape[-2], head_dim, theta, x.dtype)
        else:  # this rank's global positions (context parallelism): rows of the longer tables
            c, s = rope_tables(int(positions.max()) + 1, head_dim, theta, x.dtype)
            idx = xp.asarray(positions)
            self.c, self.s = c[idx], s[idx]
        self.head_dim = head_dim
        return _turn(x, self.c, self.s, head_dim, 1)

    def backward(self, g):
        return _turn(g, self.c, self.s, self.head_dim, -1)


def apply_rotary(x, head_dim, theta=10000.0, positions=None):
    """Rotary position embedding of positions 0..T-1 (or ``positions``, (T,) ints: the global
    positions of the tokens, under context parallelism): x (..., T, n head_dim) Tensor -> same shape."""
    return Rotary.apply(x, head_dim=head_dim, theta=theta, positions=positions)


__all__ = ["apply_rotary", "rope_tables", "Rotary"]
