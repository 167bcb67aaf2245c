"""Blocked tensor-parallel sums: the deterministic mode's fixed blocks (docs/deterministic.md).

A tensor-parallel layout of t ranks splits four kinds of sums; the deterministic mode
(pdist/engine/deterministic.py) fixes each as a sum over ``tp_blocks`` = b fixed blocks
(b = 2: the largest tp the mode accepts), summed as a balanced tree, whatever the layout:

    RowParallelLinear        Y  = sum_k X_k A_k           (K cut into b blocks)
    ColumnParallelLinear     dX = sum_k dY_k A_k^T        (columns cut into b blocks)
    vocab cross-entropy      sum_v exp(z_v - m) = sum_k sum_{v in block k} exp(z_v - m)
    SP norms / row biases    dw = sum_k sum_{tokens of shard k} (...)   (T cut into b blocks)

A tp rank holds b / t of the blocks (at t = b: one, its own shard, today's code) and the
ranks' partial sums are joined by the layer's collective (t = 2: a + b, one order, since
IEEE addition is commutative). One process (t = 1) computes every block with the shapes a
rank gives BLAS, as ``tree_sum`` of the blocks: ``blocked_column`` / ``blocked_row`` run
the very ``_linear`` a rank runs on each block (``_Take``: the block as a contiguous
copy, its gradient put back in place), so every GEMM, every column sum, sees the same
operands. The other per-element arithmetic (attention per head, GeLU, the residual) is
the same in both. Cost: b GEMMs of 1/b the size and the copies of the blocks.
"""
from pdist.engine import granules, precision
from pdist.engine.autograd import Function
from pdist.engine.backend import xp
from pdist.engine.reductions import token_col_sums
from pdist.engine.shape_ops import concat, split
from pdist.parallel.layout import Cut


def _linear(x, w, b, layout):
    """y = x W + b (W stored (in, out)) or x W^T + b (W stored (out, in))."""
    return precision.linear(x, w if layout == "in_out" else w.T, b)


def tree_sum(parts):
    """The balanced binary tree over ``parts`` (a power-of-two count), lower half on the left."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


class _Take(Function):
    """y = ``cut.take(a)`` as a contiguous copy; da = zeros with g at the cut's place."""

    def forward(self, a, cut):
        self.cut, self.shape = cut, a.shape
        return xp.ascontiguousarray(cut.take(a))

    def backward(self, g):
        lead = g.shape[:1] if granules.stacks(g, len(self.shape)) else ()    # a weight's (G, ...) stack
        out, d, pre = xp.zeros(lead + self.shape, dtype=g.dtype), self.cut.dim, (slice(None),) * len(lead)
        for sl, off in self.cut.blocks(self.shape):
            box = list(sl)
            box[d] = slice(off[d], off[d] + sl[d].stop - sl[d].start)
            out[pre + tuple(box)] = g[pre + tuple(sl)]
        return out


def take(a, cut):
    return _Take.apply(a, cut=cut)


def blocked_column(x, w, b, layout, dim, stride, nb):
    """Y = X A + b computed as nb column blocks (each of the ``stride`` fused groups cut into
    nb chunks; block k holds chunk k of every group, as rank k of a tp = nb layout does),
    reassembled in A's column order. Backward: dX is the sum of the blocks' dX (two blocks:
    one order), each block's dA, db its own GEMM and column sum."""
    ys = [_linear(x, take(w, Cut(dim, k, nb, stride)), None if b is None else take(b, Cut(0, k, nb, stride)),
                  layout) for k in range(nb)]                                    # nb x (..., out/nb)
    if stride == 1:
        return concat(ys, axis=-1)                                                   # (..., out)
    parts = [split(y, stride, axis=-1) for y in ys]
    return concat([parts[k][j] for j in range(stride) for k in range(nb)], axis=-1)


def blocked_row(x, w, layout, dim, nb):
    """Y = sum_k X_k A_k over nb blocks of K (``tree_sum``), each block's GEMM of a rank's shape."""
    last = x.ndim - 1
    return tree_sum([_linear(take(x, Cut(last, k, nb, 1)), take(w, Cut(dim, k, nb, 1)), None, layout)
                     for k in range(nb)])                                            # (..., out)


class _TokenBias(Function):
    """y = x + b; db = the token sums of g in ``blocks`` blocks of T (``token_col_sums``), the
    sums a sequence-parallel rank makes over its tokens; dx = g."""

    def forward(self, x, b, blocks):
        self.blocks = blocks
        return x + b

    def backward(self, g):
        return g, token_col_sums(g.reshape(-1, g.shape[-1]), g.shape, self.blocks)


def token_bias(x, b, blocks):
    return _TokenBias.apply(x, b, blocks=blocks)


def blocked_row_sums(e, nb):
    """sum over the last axis of e (N, V) as nb blocks of V, each summed as a rank sums its shard."""
    n = e.shape[1] // nb
    return tree_sum([xp.ascontiguousarray(e[:, k * n:(k + 1) * n]).sum(axis=1) for k in range(nb)])


__all__ = ["blocked_column", "blocked_row", "blocked_row_sums", "tree_sum", "take", "token_bias"]
