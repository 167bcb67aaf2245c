"""The deterministic mode across ranks (pdist/engine/deterministic.py holds the contract).

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

``check_layout(...)``: what the mode refuses, raised the same on every rank before any
collective, each with its reason (context parallelism's: pdist/parallel/context_deterministic.py,
which also gives ``join`` the dp x cp group's tree order).
"""
import numpy as np

from pdist.comm.algorithms import chunk_bounds
from pdist.comm.mpi import contiguous_flat
from pdist.engine.backend import to_numpy, words, xp
from pdist.engine.deterministic import GranuleTree, exact_kernels
from pdist.engine import hooks
from pdist.measure import trace
from pdist.models.plan import plan_of
from pdist.parallel.context_deterministic import check_cp, positions, under_context
from pdist.parallel.deterministic_batched import batchable, batched_compute
from pdist.parallel.tensor.transform import block_model, blockable


def prepare(det, module):
    """``Local(module, deterministic=...)``: the model's tensor-parallel sums in the policy's
    fixed blocks (``block_model``, pdist/parallel/tensor/blocks.py), so that one process
    computes them as a tp layout splits them."""
    return block_model(module, det.tp_blocks)


def check_tp(det, tp, model, sequence_parallel=False):
    """What the mode refuses under tensor parallelism over ``tp`` ranks (``model``: a model or
    its config), each with its reason; the same on every rank, before any collective."""
    b = det.tp_blocks
    if tp > b:
        raise ValueError(f"deterministic mode computes every tensor-parallel sum in tp_blocks = {b} fixed "
                         f"blocks, so it accepts tp <= {b} (got tp = {tp}): a rank holds whole blocks. Pass "
                         f"deterministic=dict(tp_blocks={tp}) (one process then computes {tp} blocks), use "
                         f"tp <= {b}, or deterministic=False")
    if b % tp:
        raise ValueError(f"deterministic mode: tp = {tp} does not divide the {b} fixed blocks; use tp in "
                         f"{[d for d in range(1, b + 1) if b % d == 0]}")
    if not blockable(model, b):
        plan = plan_of(model)
        bad = {k: n for k, n in plan.tp_sizes.items() if n % b}
        why = (f"its cut sizes {bad} are not divisible by tp_blocks = {b} (one process computes every "
               f"tensor-parallel sum in {b} blocks); choose sizes divisible by {b} or a smaller tp_blocks "
               f"(>= tp)" if plan.tensor and not plan.experts else "its plan cuts no layer (or cuts experts)")
        raise ValueError(f"deterministic mode cannot give tensor parallelism one process's bits for "
                         f"{type(model).__name__}: {why}. Or use tp = 1, or deterministic=False")


def deterministic_compute(local, x, y, loss_scale=1.0):
    """``Local.compute`` in the mode: the batched pass where it applies (``batchable``,
    pdist/parallel/deterministic_batched.py), else one forward and backward per granule of this rank's rows
    (the micro-batches are blocks of them), each granule's gradient a leaf of the tree
    (``GranuleTree``, keyed by the granule's index); this rank's subtree goes to ``det.root``.
    Returns the mean of the granules' losses. ``loss_scale`` S multiplies each granule's loss."""
    with exact_kernels():                                 # one BLAS thread, exact scatter-adds
        det = local.deterministic
        if det.cp_chunks > 1 and not under_context(local.module):   # one process: C G chunk leaves
            if not det.batched:
                raise ValueError("deterministic mode: cp_chunks > 1 in one process runs the batched pass; drop "
                                 "batched=False")
            return batched_compute(local, x, y, loss_scale)
        if batchable(det, local.module):                  # the same bits in one pass per chunk of granules
            return batched_compute(local, x, y, loss_scale)
        return _granule_loop(local, x, y, loss_scale)


def _granule_loop(local, x, y, loss_scale):
    det, params, k = local.deterministic, local.parameters(), local.microbatches
    count, g = det.local_granules(len(x))
    tree, losses, per_mb = GranuleTree(), [], count // k
    for j in range(count):
        rows = slice(j * g, (j + 1) * g)
        with hooks.span("forward", mb=j // per_mb):
            _, loss = local.module(x[rows], y[rows])
        with hooks.span("backward", mb=j // per_mb):
            (loss * loss_scale).backward() if loss_scale != 1.0 else loss.backward()
        for hook in det.granule_hooks:               # sequence parallelism: the partial grads' tp sum
            hook()
        tree.add(j, det.leaf(params))
        losses.append(loss.data)
    det.root = tree.root()
    return sum(float(v) for v in to_numpy(xp.stack(losses))) / count


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
    the tree's order (under cp the dp x cp group's: pdist/parallel/context_deterministic.py)."""
    det.root = join_root(det.root, group, positions(det, group.size))


def join_all(det, group):
    """``join`` over the data-parallel ``group``, then, under expert parallelism, the experts'
    trees over their edp group into the experts' slots (pdist/parallel/expert_deterministic.py)."""
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


class PipelineTree:
    """A pipeline stage's keeper in the mode (the ``pipeline_grads`` interface of
    pdist/engine/grad_rounding.py). Under a pipeline a micro-batch is one granule (dp * m = G).
    ``after_backward(k, mb)`` (after virtual stage k's BACKWARD, or W, of micro-batch mb) adds
    every ``.grad`` of this rank into granule mb's flat fp32 leaf and zeroes it: the other
    chunks' gradients are zero then, and v + 0 = v, so each slot holds its own stage's value.
    ``finish()``: a tied embedding's two parts of each granule, e_j + h_j, are summed over the
    first and last stage (two terms: one order) and rounded to the weight's dtype, as one
    process sums the two uses in its ``.grad``; then the m leaves form the tree (``det.root``),
    for the data-parallel join. Memory: m leaves of Ψ_stage fp32 until the step's end."""

    def __init__(self, pipe):
        self.det, self.params, m = pipe.deterministic, pipe.inner.parameters(), pipe.num_microbatches
        self.leaves = [xp.zeros(sum(self.det.sizes), dtype=np.float32) for _ in range(m)]   # m x (Ψ_stage,)
        offs = np.cumsum([0] + self.det.sizes)
        where = {id(q): (int(offs[i]), int(offs[i + 1])) for i, q in enumerate(self.params)}
        tied = list(pipe.tied) + list(pipe.local_tied)
        self.tied = [(q, where[id(q)]) for q in tied]
        self.group = pipe.embedding_group

    def backward_scale(self, loss_scale):
        return loss_scale                       # each granule's own mean loss; 1/G at the root

    def after_backward(self, k, mb=None):
        for hook in self.det.granule_hooks:          # sequence parallelism: the partial grads' tp sum
            hook()
        leaf, off = self.leaves[mb], 0
        for q, n in zip(self.params, self.det.sizes):
            if q.grad is not None:
                leaf[off:off + n] += q.grad.reshape(-1).astype(np.float32)
                q.grad[...] = 0
            off += n

    def finish(self):
        if self.group is not None and self.tied:                 # e_j on the first stage, h_j on the last
            parts = xp.stack([xp.concatenate([v[a:b] for _, (a, b) in self.tied]) for v in self.leaves])
            self.group.all_reduce(parts, op="sum")               # (m, Σ tied)
            for v, row in zip(self.leaves, parts):
                o = 0
                for _, (a, b) in self.tied:
                    v[a:b], o = row[o:o + b - a], o + b - a
        for q, (a, b) in self.tied:                              # one rounding of e_j + h_j, as one process
            for v in self.leaves:
                v[a:b] = v[a:b].astype(q.dtype).astype(np.float32)
        tree = GranuleTree()
        for j, v in enumerate(self.leaves):
            tree.add(j, v)
        self.det.root, self.leaves = tree.root(), []

    def sync_tied(self, group):
        pass                                                     # done in finish(), before the dp join


def check_layout(det, cfg, dp, tp=1, pp=1, cp=1, ep=1, chunks=1, microbatches=1, precision="fp32",
                 sequence_parallel=False, context_parallel=None):
    """Every layout the deterministic mode refuses, with the reason (docs/deterministic.md)."""
    check_cp(det, cfg, dp, cp, tp, pp > 1 or chunks > 1, context_parallel)    # cp: Ulysses, cp_chunks = cp
    check_experts(getattr(cfg, "n_expert", 0), pp > 1 or chunks > 1)
    if tp > 1:
        check_tp(det, tp, cfg, sequence_parallel)
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"deterministic mode covers precision 'fp32' and 'bf16', got {precision!r} (fp16's "
                         f"dynamic loss scale skips steps on overflow; its bits are not part of the contract)")
    if getattr(cfg, "dropout", 0):
        raise ValueError(f"deterministic mode needs dropout = 0 (got {cfg.dropout}): a mask drawn per granule "
                         f"differs from one drawn per batch")
    det.check(dp, microbatches, pp > 1 or chunks > 1)


def check_experts(n_expert, pipeline=False):
    """What the mode refuses for a mixture of ``n_expert`` experts (pdist/parallel/expert_deterministic.py),
    the same on every rank, before any collective."""
    if n_expert and pipeline:
        raise ValueError(f"deterministic mode: a mixture of experts (n_expert={n_expert}) under a pipeline is "
                         f"not a granule tree yet (the stages' micro-batch leaves do not keep the experts' "
                         f"per-source trees); use pp = 1 and chunks = 1, or deterministic=False")


def finish_zero(z):
    """ZeRO's gradient sync in the deterministic mode: the granule trees joined over z's group
    (every rank gets the whole mean, in canonical order), then this rank keeps its shard."""
    join_all(z.deterministic, z.group)
    for u in z.units:
        u.ensure_grad_views()
    z.inner.finish_grad_sync()             # Local writes the mean into the flat views
    for u in z.units:
        if z.stage == 0:
            u.shard.grad = u.grad_flat
        elif z.stage == 1:
            u.shard.grad = u.grad_flat[u.lo:u.hi]
        else:
            u.shard.grad = u.grad_flat[u.lo:u.hi].copy()
            u.drop_grads()
            if z.stage == 3:
                u.free()                   # an expert's unit stays gathered until here (its "reduction")


__all__ = ["TreeSums", "tree_all_reduce", "join", "join_all", "join_root", "check_layout", "check_experts",
           "check_tp", "prepare", "deterministic_compute", "PipelineTree", "finish_zero"]
