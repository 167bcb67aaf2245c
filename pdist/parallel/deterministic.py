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

``check_layout(...)``: what the mode refuses, raised the same on every rank before any
collective, each with its reason.
"""
import numpy as np

from pdist.engine.backend import to_numpy, xp
from pdist.engine.deterministic import GranuleTree
from pdist.measure import hooks, trace


def deterministic_compute(local, x, y, loss_scale=1.0):
    """``Local.compute`` in the mode: one forward and backward per granule of this rank's rows
    (the micro-batches are blocks of them), each granule's gradient a leaf of the tree
    (``GranuleTree``, keyed by the granule's index); this rank's subtree goes to ``det.root``.
    Returns the mean of the granules' losses. ``loss_scale`` S multiplies each granule's loss."""
    det, params, k = local.deterministic, local.parameters(), local.microbatches
    count, g = det.local_granules(len(x))
    tree, losses, per_mb = GranuleTree(), [], count // k
    for j in range(count):
        rows = slice(j * g, (j + 1) * g)
        with hooks.span("forward", mb=j // per_mb):
            _, loss = local.module(x[rows], y[rows])
        with hooks.span("backward", mb=j // per_mb):
            (loss * loss_scale).backward() if loss_scale != 1.0 else loss.backward()
        tree.add(j, det.leaf(params))
        losses.append(loss.data)
    det.root = tree.root()
    return sum(float(v) for v in to_numpy(xp.stack(losses))) / count


def join(det, group):
    """Join this rank's subtree ``det.root`` with the group's (module docstring)."""
    n, r = group.size, group.rank
    level, index, buf = det.root
    other = xp.empty_like(buf)
    s = 1
    t0 = trace.now()
    while s < n:
        q = r ^ s
        group.sendrecv(buf, q, other, q, tag=0)
        buf = xp.add(buf, other, out=buf) if r < q else xp.add(other, buf, out=buf)
        level, index, s = level + 1, index >> 1, s << 1
    det.root = (level, index, buf)
    trace.record("det.join", "dp", t0, trace.now(), bytes=int(buf.nbytes) * int(np.log2(n)))


def check_layout(det, cfg, dp, tp=1, pp=1, cp=1, ep=1, chunks=1, microbatches=1, precision="fp32"):
    """Every layout the deterministic mode refuses, with the reason (docs/deterministic.md)."""
    split = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "chunks": chunks}
    other = {k: v for k, v in split.items() if v > 1}
    if other or getattr(cfg, "n_expert", 0):
        raise ValueError(f"deterministic mode covers data parallelism and ZeRO 0-3 so far; got "
                         f"{other or {'n_expert': cfg.n_expert}}: the row-parallel K-sums (tp), the pipeline's "
                         f"micro-batch gradients (pp), the token-shard sums (cp) and the expert routing (ep) "
                         f"are not granule trees yet. Use tp = pp = cp = ep = 1, or deterministic=False")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"deterministic mode covers precision 'fp32' and 'bf16', got {precision!r} (fp16's "
                         f"dynamic loss scale skips steps on overflow; its bits are not part of the contract)")
    if getattr(cfg, "dropout", 0):
        raise ValueError(f"deterministic mode needs dropout = 0 (got {cfg.dropout}): a mask drawn per granule "
                         f"differs from one drawn per batch")
    det.check(dp, microbatches)


__all__ = ["join", "check_layout"]
