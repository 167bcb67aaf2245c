"""The deterministic mode across ranks: the granule trees joined in the tree's own order.

``join(det, group)``: rank r of a power-of-two group holds the subtree sum of the aligned
granule block r (level l, index r). Recursive doubling: at step s = 0, 1, ..., partner
q = r XOR 2^s; both hold sibling subtrees of level l + s, exchange them (sendrecv) and
form their parent, lower block on the left: S = S_lower + S_upper. After log2(n) steps
every rank holds the root of the whole tree, the same bits as one process summing its
G granules as the tree (Thakur, Rabenseifner & Gropp, 2005, recursive doubling; here
chosen for its fixed order, not its latency). It sends log2(n) Ψ fp32 words per rank
(an all-reduce in a ring sends 2(n-1)/n Ψ): the price of a canonical order. ZeRO joins
the same way and keeps its shard.

``TreeSums(group)``: the tp group whose sums (all-reduce, reduce-scatter) run the same
recursive doubling in the buffer's own dtype, so t > 2 ranks' partials are joined as the
tree ((b_0 + b_1) + (b_2 + b_3)) that one process sums its blocks in (blocks.py).
"""
import numpy as np

from pdist.comm.algorithms import chunk_bounds
from pdist.comm.mpi import contiguous_flat
from pdist.engine.backend import words, xp
from pdist.measure import trace
from pdist.parallel.deterministic.context import positions


def tree_all_reduce(group, buf):
    """buf <- the balanced tree over the group's buf (a power of two of ranks), lower ranks on
    the left, in buf's dtype (2-byte floats travel as their words), the same bits everywhere."""
    n, r, s = group.size, group.rank, 1
    other = xp.empty_like(buf)
    while s < n:
        q = r ^ s
        group.sendrecv(words(buf), q, words(other), q, tag=0)
        xp.add(buf, other, out=buf) if r < q else xp.add(other, buf, out=buf)
        s <<= 1
    return buf


class TreeSums:
    """The group ``group`` whose sum reductions add in the tree's order (``tree_all_reduce``);
    every other call is the group's own. The reduce-scatter sums the whole buffer so (it sends
    log2(t) S per rank, a ring (t - 1)/t S: the price of the canonical order) and keeps its chunk."""

    def __init__(self, group):
        self.group = group

    def __getattr__(self, name):
        return getattr(self.group, name)

    def all_reduce(self, buf, op="sum", algorithm=None, async_op=False):
        if op in ("max", "min"):             # no order to fix
            return self.group.all_reduce(buf, op=op, algorithm=algorithm, async_op=async_op)
        if op not in ("sum", "avg"):
            raise ValueError(f"all_reduce: op must be one of sum, avg, max, min, got {op!r}")
        t0 = trace.now()
        tree_all_reduce(self.group, contiguous_flat(buf, "all_reduce buf"))
        if op == "avg":
            buf /= self.size
        trace.record("det.tp_sum", "tp", t0, trace.now(), bytes=int(buf.nbytes) * int(np.log2(self.size)))

    def reduce_scatter(self, out, inp, op="sum", algorithm=None, async_op=False):
        if op != "sum":
            raise ValueError(f"deterministic mode: a tensor-parallel reduce-scatter sums; got op={op!r}")
        full = xp.array(inp, copy=True).reshape(-1)
        self.all_reduce(full)
        a, b = chunk_bounds(full.size, self.size)[self.rank]
        out.reshape(-1)[...] = full[a:b]


def join(det, group):
    """Join this rank's subtree ``det.root`` with the group's (module docstring), its ranks in
    the tree's order (under cp the dp x cp group's: pdist/parallel/deterministic/context.py)."""
    det.root = join_root(det.root, group, positions(det, group.size))


def join_all(det, group):
    """``join`` over the data-parallel ``group``, then, under expert parallelism, the experts'
    trees over their edp group into the experts' slots (pdist/parallel/deterministic/experts.py)."""
    join(det, group)
    if det.experts is not None:
        det.experts.finish()


def join_root(root, group, order=None):
    """(level, index, buf) of this rank's subtree -> that of the group's joined tree. ``order``:
    (tree position of each group rank, group rank at each position); None: the identity."""
    n = group.size
    pos, rank_at = order or (range(n), range(n))
    r = pos[group.rank]
    level, index, buf = root
    other = xp.empty_like(buf)
    s = 1
    t0 = trace.now()
    while s < n:
        q = r ^ s
        group.sendrecv(buf, rank_at[q], other, rank_at[q], tag=0)
        buf = xp.add(buf, other, out=buf) if r < q else xp.add(other, buf, out=buf)
        level, index, s = level + 1, index >> 1, s << 1
    trace.record("det.join", "dp", t0, trace.now(), bytes=int(buf.nbytes) * int(np.log2(n)))
    return level, index, buf


__all__ = ["TreeSums", "tree_all_reduce", "join", "join_all", "join_root"]
