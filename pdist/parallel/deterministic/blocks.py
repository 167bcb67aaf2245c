"""Blocked tensor-parallel sums: the deterministic mode's fixed blocks (docs/deterministic.md).

A tensor-parallel layout of t ranks splits four kinds of sums; the deterministic mode
(pdist/parallel/deterministic/policy.py) fixes each as a sum over ``tp_blocks`` = b fixed blocks
(the policy's field, default 2, any power of two: the largest tp the mode accepts), summed
as a balanced tree ((b_0 + b_1) + (b_2 + b_3) at b = 4), whatever the layout:

    RowParallelLinear        Y  = sum_k X_k A_k           (K cut into b blocks)
    ColumnParallelLinear     dX = sum_k dY_k A_k^T        (columns cut into b blocks)
    vocab cross-entropy      sum_v exp(z_v - m) = sum_k sum_{v in block k} exp(z_v - m)
    norms / row biases       dw = sum_k sum_{tokens of shard k} (...)   (T cut into b blocks)

A tp rank holds b / t of the blocks (at t = b: one, its own shard, today's code), sums them
as its subtree, and the ranks' partial sums are joined by the layer's collective in the
tree's order (t = 2: a + b, one order, since IEEE addition is commutative; t > 2: recursive
doubling, ``TreeSums`` in pdist/parallel/deterministic/join.py). One process (t = 1) computes every
block with the shapes a rank gives BLAS, as ``tree_sum`` of the blocks: ``blocked_column`` /
``blocked_row`` run the very ``_linear`` a rank runs on each block (``_Take``: the block as a
contiguous copy, its gradient put back in place), so every GEMM, every column sum, sees the
same operands. The other per-element arithmetic (attention per head, GeLU, the residual) is
the same in both. Cost: b GEMMs of 1/b the size and the copies of the blocks.

Column layers that share an input (Llama's q, k, v and gate, up: c consumers) add their
input gradients: dX = sum_k sum_c dY_{k,c} A_{k,c}^T. The canonical order (``Fan``): in each
block k the consumers in the plan's order, ((c_0 + c_1) + c_2), then the blocks as the tree,
whatever order the backward walk reaches them; a rank does the same on its blocks.
"""
from pdist.engine.autograd import Function
from pdist.engine.backend import xp
from pdist.engine.reductions import ones
from pdist.engine.shape_ops import concat, split
from pdist.parallel.deterministic import granules
from pdist.parallel.layout import Cut
from pdist.parallel.tensor.layers import _linear
from pdist.parallel.tensor.regions import SharedInput


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


class Fan:
    """One input X read by ``consumers`` column layers in ``nb`` blocks each: slot (k, c) is
    block k of consumer c. Backward: dX = tree_k (((g_{k,0} + g_{k,1}) + ...) + g_{k,c-1}),
    the module docstring's canonical order, whichever slot the walk reaches last."""

    def __init__(self, nb, consumers=1):
        self.nb, self.consumers, self.grads = nb, consumers, {}

    def slots(self, x, c=0):
        return [_Slot.apply(x, fan=self, key=(k, c)) for k in range(self.nb)]

    def add(self, key, g):
        self.grads[key] = g
        if len(self.grads) < self.nb * self.consumers:
            return None                              # the last slot to arrive returns the sum
        gs, self.grads, parts = self.grads, {}, []
        for k in range(self.nb):
            s = gs[(k, 0)]
            for c in range(1, self.consumers):
                s = s + gs[(k, c)]
            parts.append(s)
        return tree_sum(parts)


class _Slot(Function):
    """y = x (a slot of a ``Fan``); dx: None until the fan's last slot, then the fan's sum."""

    def forward(self, x, fan, key):
        self.fan, self.key = fan, key
        return x

    def backward(self, g):
        return self.fan.add(self.key, g)


class FanInput(SharedInput):
    """The tensor-parallel ``SharedInput`` whose reading layers each get their ``Fan`` slots,
    ``blocks`` of them (``join()`` gave the layers their consumer index, in the plan's order):
    dX is summed in the canonical order whichever layer the backward walk reaches last."""

    blocks, _fan = 1, None

    def __call__(self, x, consumer=0):
        fresh = self._x is None or self._x() is not x or self._y() is None
        y = super().__call__(x, consumer)
        if fresh:
            self._fan = Fan(self.blocks, self.consumers)
        return self._fan.slots(y, consumer)


def blocked_column(x, w, b, layout, dim, stride, nb):
    """Y = X A + b computed as nb column blocks (each of the ``stride`` fused groups cut into
    nb chunks; block k holds chunk k of every group, as rank k of a tp = nb layout does),
    reassembled in A's column order. ``x``: the input, or its nb ``Fan`` slots (a shared
    input). Backward: dX is the tree of the blocks' dX (``Fan``), each block's dA, db its own
    GEMM and column sum."""
    xs = x if isinstance(x, list) else Fan(nb).slots(x) if nb > 1 else [x]
    if nb == 1:
        return _linear(xs[0], w, b, layout)                                          # (..., out)
    ys = [_linear(xs[k], take(w, Cut(dim, k, nb, stride)), None if b is None else take(b, Cut(0, k, nb, stride)),
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


def token_col_sums(a2, shape, blocks):
    """The column sums of a2 (N, C), the rows of an activation of ``shape`` (..., T, C), as
    ``blocks`` blocks of the T axis, each summed alone, then added as a balanced tree: the
    sums a sequence-parallel rank makes over its T / blocks tokens (the norms' and row biases'
    gradients). ``blocks`` = 1: one sum. In the batched pass (granules.py) one sum per
    granule, a (G, C) stack."""
    if blocks == 1:
        return granules.col_sums(a2, ones)
    T, C = shape[-2], a2.shape[1]
    if T % blocks:
        raise ValueError(f"deterministic mode: the sequence length T = {T} does not split into {blocks} "
                         f"token blocks (the token shards of sequence parallelism); use T divisible by {blocks}")
    a3, n = a2.reshape(-1, T, C), T // blocks                                          # (B, T, C)
    return tree_sum([granules.col_sums(xp.ascontiguousarray(a3[:, k * n:(k + 1) * n]).reshape(-1, C), ones)
                     for k in range(blocks)])


def blocked_row_sums(e, nb):
    """sum over the last axis of e (N, V) as nb blocks of V, each summed as a rank sums its shard."""
    n = e.shape[1] // nb
    return tree_sum([xp.ascontiguousarray(e[:, k * n:(k + 1) * n]).sum(axis=1) for k in range(nb)])


__all__ = ["Fan", "FanInput", "blocked_column", "blocked_row", "blocked_row_sums", "token_col_sums", "tree_sum", "take",
           "token_bias"]
