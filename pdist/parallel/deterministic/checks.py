"""What the deterministic mode refuses, each with its reason, raised the same on every rank
before any collective (docs/deterministic.md): ``parallelize(..., deterministic=...)`` calls
``check_layout`` first."""
from pdist.parallel.deterministic.context import check_cp
from pdist.parallel.deterministic.experts import check_experts
from pdist.parallel.deterministic.tensor import check_tp


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


__all__ = ["check_layout"]
