"""The deterministic mode: the same bits on every layout (``Local(model, deterministic=True)``,
``parallelize(..., deterministic=True)``; docs/deterministic.md).

Contract. After any number of steps, every parameter and every Adam m, v of a run in
this mode equal, bit for bit (``np.array_equal``), those of one process in this mode on
the same global batches, in float32 and in bf16 (fp32 masters), for every layout the
mode accepts: dp and microbatches m powers of two with dp * m dividing G, ZeRO 0-3, pipelines
(dp * m = G), and tp <= ``tp_blocks`` (2 by default, any power of two:
``deterministic=dict(tp_blocks=4)``) with or without sequence parallelism (every sum tp splits
computed in tp_blocks fixed blocks as a balanced tree, one process included:
pdist/parallel/deterministic/blocks.py), and a mixture of experts with its experts over ep ranks,
ZeRO 0-3 (each expert's gradient summed per source granule: pdist/parallel/deterministic/experts.py),
and Ulysses context parallelism over cp = ``cp_chunks`` ranks, with dp and ZeRO (the leaves are
(token chunk, granule), C G of them: pdist/parallel/deterministic/context.py).

Why bits differ otherwise. IEEE addition is commutative (a + b == b + a, bit for bit) but
not associative: (a + b) + c != a + (b + c) in general. So a sum's bits depend only on the
shape of its tree, and every layout that splits a batch sum (over ranks, over
micro-batches) changes the tree. The mode fixes it:

* Granules. The global batch of B rows is cut into G granules of g = B / G rows (G, a
  power of two, does not depend on the layout; default 16). Each granule is computed as
  its own forward and backward would compute it (one batched pass over a rank's granules
  gives those bits: pdist/parallel/deterministic/batched.py), so every op (every BLAS call, every row sum inside LayerNorm's
  gain gradient, every scatter-add of the embedding) sees the same shapes and the same
  data in every layout: granule j's gradient d_j = dL_j/dw (L_j: the mean loss over its
  g T tokens) has the same bits everywhere.
* A fixed tree. The step's gradient is g = (1/G) S(0, G), S(lo, hi) the balanced binary
  tree: S(j, j+1) = d_j, S(lo, hi) = S(lo, mid) + S(mid, hi), mid = (lo + hi) / 2. Its
  partial sums are kept keyed by their node (level, index) (``GranuleTree``): a node is
  summed when its sibling arrives, so any order of arrival gives the same tree. A rank
  holding the aligned block of granules [r G/dp, (r+1) G/dp) holds the whole subtree of
  that block; recursive doubling with partners r XOR 2^s (pdist/parallel/deterministic/join.py)
  joins the subtrees level by level in the tree's own order. MPI's Allreduce promises no
  order; this exchange is the hand-built one. The sums run in float32 (bf16 granule
  gradients are upcast exactly) and are rounded to the parameters' dtype once, at the end.
* Scaling: L = (1/G) sum_j L_j (the granules hold equal token counts), applied once to the
  root, the same in every layout.

The default mode is untouched: a strategy without this policy runs today's code.
Cost: per-granule GEMMs and gradient stacks in one pass (a pipeline: G passes of g rows), and
one flat fp32 copy of the gradients per granule of a chunk (bench/deterministic.py measures the ratio).
"""
import numpy as np

from pdist.engine.backend import xp

DEFAULT_GRANULES = 16       # the largest dp * microbatches the default mode accepts
TP_BLOCKS = 2               # every tensor-parallel sum in this many fixed blocks (default): the largest tp accepted


def _pow2(n):
    return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


class GranuleTree:
    """Partial sums of a balanced binary tree over granules, keyed by node (level, index):
    leaf j is (0, j); node (l, i) = (l-1, 2i) + (l-1, 2i+1), left first. ``add(j, v)``
    inserts leaf j and sums every node whose sibling is present, so the result does not
    depend on the order of the leaves. ``root()``: the single node left (the block must be
    an aligned power of two, else ValueError naming the nodes)."""

    def __init__(self):
        self.nodes = {}

    def add(self, index, value, level=0):
        """Node (level, index) (a leaf at level 0; a whole subtree summed elsewhere above)."""
        while (level, index ^ 1) in self.nodes:
            sib = self.nodes.pop((level, index ^ 1))
            left, right = (sib, value) if index & 1 else (value, sib)
            value = xp.add(left, right, out=left)
            level, index = level + 1, index >> 1
        self.nodes[(level, index)] = value

    def root(self):
        if len(self.nodes) != 1:
            raise ValueError(f"the granules do not form one aligned subtree: nodes {sorted(self.nodes)}; "
                             "a block of granules must be a power of two, aligned to its size")
        (level, index), value = next(iter(self.nodes.items()))
        return level, index, value


class Deterministic:
    """The policy a ``Local`` holds in deterministic mode (module docstring): ``granules``
    G, a power of two; ``tp_blocks``: the fixed blocks of every sum tensor parallelism splits
    (the K-sums of row-parallel layers, column-parallel input gradients, the vocabulary of the
    cross-entropy; pdist/parallel/deterministic/blocks.py); ``shards``: the data-parallel ranks the batch is cut over (set by
    DataParallel / ZeRO with ``shard_over``); ``root``: this rank's fp32 subtree sum of the
    step (flat, parameters in ``Local.parameters()`` order), joined over the ranks by the
    data-parallel wrapper; ``batched``: the rank's granules in one pass, the same bits
    (pdist/parallel/deterministic/batched.py; False: one pass per granule); ``cp_chunks`` C: the
    token chunks of context parallelism over C ranks, each granule's gradient then C leaves
    (pdist/parallel/deterministic/context.py; 1: the granules alone, the default)."""

    def __init__(self, granules=DEFAULT_GRANULES, tp_blocks=TP_BLOCKS, batched=True, cp_chunks=1):
        for name, v in (("granules", granules), ("tp_blocks", tp_blocks), ("cp_chunks", cp_chunks)):
            if not _pow2(v):
                raise ValueError(f"deterministic mode: {name} must be a power of two, got {v!r}")
        self.granules, self.shards, self.root = int(granules), 1, None
        self.batched = bool(batched)    # one pass over the rank's granules where it applies (batched.py)
        self.tp_blocks = int(tp_blocks)  # the blocks of every tensor-parallel sum (pdist/parallel/deterministic/blocks.py)
        self.granule_hooks = []         # called after each granule's backward, before its leaf (SP's tp sums)
        self.experts = None             # expert parallelism's per-source trees (pdist/parallel/deterministic/experts.py)
        self.cp_chunks = int(cp_chunks)  # C token chunks per row: C G leaves (pdist/parallel/deterministic/context.py)
        self.cp_ranks = 1               # cp of this rank's layout (set by check_layout): the dp wrapper spans dp x cp

    @classmethod
    def of(cls, arg):
        """``True`` -> the default policy (G = 16, tp_blocks = 2); an int -> that many granules;
        a dict -> ``Deterministic(**arg)`` (``dict(granules=16, tp_blocks=4, batched=True, cp_chunks=1)``);
        a policy -> itself;
        ``False``/``None`` -> None (the default mode)."""
        if arg is None or arg is False:
            return None
        if isinstance(arg, Deterministic):
            return arg
        if arg is True:
            return cls()
        if isinstance(arg, dict):
            unknown = sorted(set(arg) - {"granules", "tp_blocks", "batched", "cp_chunks"})
            if unknown:
                raise ValueError(f"deterministic mode: unknown option(s) {unknown}; use granules=<power of two>, "
                                 "tp_blocks=<power of two>, batched=<bool>, cp_chunks=<power of two>")
            return cls(**arg)
        return cls(arg)

    def check(self, dp, microbatches, pipeline=False):
        """dp and microbatches must be powers of two with dp * m dividing G: then every rank's
        micro-batch holds an aligned block of granules, a whole subtree. Under a pipeline a
        micro-batch is one granule: dp * m = G."""
        for name, v in (("the data-parallel size", dp), ("microbatches", microbatches)):
            if not _pow2(v):
                raise ValueError(f"deterministic mode needs {name} to be a power of two (got {v}): the "
                                 f"granule tree is binary, and only power-of-two blocks are whole subtrees")
        if self.granules % (dp * microbatches):
            raise ValueError(f"deterministic mode: dp * microbatches = {dp * microbatches} does not divide "
                             f"granules = {self.granules}; pass deterministic=<a power of two >= "
                             f"{dp * microbatches}> (the granule count)")
        if pipeline and dp * microbatches != self.granules:
            raise ValueError(f"deterministic mode under a pipeline: each micro-batch is one granule, so dp * "
                             f"microbatches must equal granules = {self.granules} (got dp={dp}, microbatches="
                             f"{microbatches}); use microbatches={max(self.granules // dp, 1)} or "
                             f"deterministic={dp * microbatches}")

    def shard_over(self, n, microbatches, pipeline=False):
        """The data-parallel wrapper's ``n`` ranks (``check``); under cp they span dp x cp, and
        the batch's rows are cut over the n / cp dp ranks."""
        n //= self.cp_ranks
        self.check(n, microbatches, pipeline)
        self.shards = n

    def local_granules(self, rows):
        """(count, g): this rank's granules and their rows, from its ``rows`` of the batch."""
        count = self.granules // self.shards
        if rows % count:
            B = rows * self.shards
            raise ValueError(f"deterministic mode: the global batch of {B} rows does not split into "
                             f"{self.granules} granules; use a batch size divisible by {self.granules} "
                             f"(or fewer granules: deterministic=<power of two>)")
        return count, rows // count

    def bind(self, params):
        """Record the parameters' shapes (ZeRO-3 later frees their data between uses)."""
        self.shapes = [tuple(p.shape) for p in params]
        self.sizes = [int(np.prod(s)) for s in self.shapes]

    def leaf(self, params):
        """Granule gradient as one flat fp32 vector (exact upcast; -0 becomes +0), and every
        ``p.grad`` zeroed in place for the next granule."""
        out = xp.zeros(sum(self.sizes), dtype=np.float32)                              # (Ψ,)
        off = 0
        for p, n in zip(params, self.sizes):
            if p.grad is not None:
                out[off:off + n] += p.grad.reshape(-1).astype(np.float32)
                p.grad[...] = 0
            off += n
        return out

    def write(self, params):
        """g = (1/(C G)) S(0, C G) (C = cp_chunks, 1 by default) into every ``p.grad`` (in place
        where it exists: DDP's bucket views, ZeRO's flat views), rounded once to the parameter's dtype."""
        level, _, root = self.root
        leaves = self.granules * self.cp_chunks        # (chunk, granule) leaves (C = 1: the granules)
        if (1 << level) != leaves:
            raise RuntimeError(f"deterministic mode: the step's tree holds {1 << level} of {leaves} leaves "
                               f"({self.granules} granules x cp_chunks {self.cp_chunks}); a data-parallel wrapper must join "
                               "the ranks' subtrees, and a pipeline "
                               "alone needs microbatches = granules (each micro-batch one granule)")
        root *= np.float32(1.0 / leaves)               # each leaf's seeds: 1 / (its g T / C tokens)
        off = 0
        for p, n, shape in zip(params, self.sizes, self.shapes):
            g = root[off:off + n].reshape(shape)
            if p.grad is None:
                p.grad = g.astype(p.dtype)
            else:
                p.grad[...] = g
            off += n
        self.root = None

    def __repr__(self):
        return (f"Deterministic(granules={self.granules}, tp_blocks={self.tp_blocks}"
                f"{'' if self.batched else ', batched=False'}{f', cp_chunks={self.cp_chunks}' * (self.cp_chunks > 1)})")


class InMode:
    """A wrapper of a chain in the mode (the mixins' base): the policy is its ``Local``'s."""

    deterministic = property(lambda self: self.inner.deterministic)


__all__ = ["Deterministic", "GranuleTree", "InMode", "DEFAULT_GRANULES", "TP_BLOCKS"]
