"""Hybrid sharding (HSDP): ZeRO inside a shard group, plain replicas across them.

The dp ranks form an R x S grid (``DeviceMesh(dp_replicate=R, dp_shard=S)``; dp rank
d = r S + s). The S ranks of a *shard group* (same r: one node) hold one model between them
as ZeRO stage 1-3 does (Rajbhandari et al., 2020); the R shard groups are replicas of each
other, and rank s of every group holds the same shard. This is MiCS's "scale-aware
partition" (Zhang et al., 2022, "MiCS: Near-linear Scaling for Training Gigantic Model on
Public Cloud"), PyTorch FSDP's HYBRID_SHARD (Zhao et al., 2023, "PyTorch FSDP: Experiences
on Scaling Fully Sharded Data Parallel"), DeepSpeed's hpZ and torchtitan's HSDP.

The gradient. Rank d trains on rows [d B/RS, (d+1) B/RS) of the global batch, so its loss
L_d is the mean over B/RS rows and the gradient of the global mean is the mean over all RS
ranks. A mean over a grid is the mean of the row means:

    g = (1/RS) sum_{r,s} g_{r,s} = (1/R) sum_r [ (1/S) sum_s g_{r,s} ]

so each unit's gradient is first reduce-scattered (average) inside the shard group, which
leaves rank s with shard s of its group's mean, and then that shard is all-reduced
(average) across the R replicas holding shard s: every rank ends with shard s of g, the
same as ZeRO over all RS ranks, and AdamW, elementwise, updates it as one process would.
Parameters are all-gathered inside the shard group only (stage 1-2 after the step,
stage 3 around each unit's forward and backward), never across replicas.

Bytes per rank per step (ring accounting, b bytes per element, Ψ_pad = Σ_units
ceil(Ψ_u/S)·S, the unit's flat buffer padded for S shards):

    shard group (S ranks)      ZeRO's formulas with N = S: stage 1-2 2(S-1)/S bΨ_pad,
                               stage 3 (2m+1)(S-1)/S bΨ_pad (m micro-batches)
    replicate group (R ranks)  one all-reduce of the padded flat shard: 2(R-1)/R b Ψ_pad/S

The cross-node group moves 1/S of DDP's bytes, and the shard group, inside a node, moves
ZeRO's. Under context parallelism (cp ranks per sequence, ``parallelize`` with
``context_parallel=``) the shard group is the dp_shard x cp ranks (``mesh.dp_shard_cp_group``,
as torchtitan shards over dp_shard x cp): S above reads S·cp, and the mean over its ranks of
their T/cp-token means is again the mean over their rows. Memory is ZeRO's with N = S (the formulas of zero.py). With R = 1 this is ZeRO; with
S = 1 each "shard" is the whole unit and the all-reduce across replicas is DDP's.

Schedule: as ZeRO's (zero.py); when a unit's reduce-scatter finishes, its shard's
all-reduce across replicas starts asynchronously (at most one in flight), and all are
waited on before the optimizer step. The per-step loss sums over the shard group and
then over a private copy of the replicate group.
"""
import numpy as np

from pdist import comm
from pdist.parallel.zero.zero import ZeRO


def check_hybrid(cfg, mesh, zero_stage, deterministic=False):
    """What HSDP (dp_replicate > 1 with zero_stage >= 1) does not compose with yet, refused the
    same on every rank before any collective, naming the input and the fix."""
    R = getattr(mesh, "dp_replicate_world_size", 1)
    if R == 1 or not zero_stage:
        return
    what = f"HSDP (dp_replicate={R}, dp_shard={getattr(mesh, 'dp_shard_world_size', 1)}, zero_stage={zero_stage})"
    fix = "use dp_replicate=1 (ZeRO over all of dp) or zero_stage=0 (DDP over all of dp)"
    if getattr(cfg, "n_expert", 0):
        raise ValueError(f"{what} does not run a mixture-of-experts model (n_expert={cfg.n_expert}) yet: {fix}")
    if deterministic:
        raise ValueError(f"{what} does not run in the deterministic mode yet: use deterministic=False, or {fix}")


class HSDP(ZeRO):
    """``HSDP(inner, stage, shard_group, replicate_group, dp_group=None)``: ZeRO stage 1-3 over
    ``shard_group`` (S ranks), each shard's gradient then averaged over ``replicate_group`` (the
    R ranks holding the same shard); ``dp_group``: all R x S ranks (the state dicts' group when
    HSDP alone wraps the model; default the world). Rank s of replica r trains on rows
    [(r S + s) B/RS, (r S + s + 1) B/RS). Module docstring: the math and the bytes."""

    def __new__(cls, module, *args, **kw):
        mode = getattr(module, "mode", None)
        if mode is not None:
            raise TypeError(f"HSDP does not run in the {mode} mode yet: build it without {mode}=, or use ZeRO "
                            f"over the whole dp group")
        return super().__new__(cls, module, *args, **kw)

    def __init__(self, module, stage, shard_group, replicate_group, dp_group=None, units=None, prefetch=True):
        if stage not in (1, 2, 3):
            raise ValueError(f"HSDP shards with ZeRO stage 1, 2 or 3, got stage={stage!r}; stage 0 over the "
                             f"whole dp group is plain data parallelism (DataParallel)")
        if replicate_group is None:
            raise ValueError("HSDP needs replicate_group (DeviceMesh(dp_replicate=, dp_shard=).dp_replicate_group)")
        super().__init__(module, stage, shard_group, units, prefetch)
        self.replicate_group, self.dp_group = replicate_group, dp_group
        R, S = replicate_group.size, self.group.size
        self.dp_shard_rank, self.dp_replicate_rank = self.group.rank, replicate_group.rank
        self.dp_rank, self.dp_world_size = replicate_group.rank * S + self.group.rank, R * S   # local_batch's rows
        self.loss_weight = 1.0 / S     # reduce_stats: over the shard group, then 1/R over the replicas
        self._rep_aux = replicate_group.split(0, name=f"{replicate_group.name}.step") if R > 1 else None
        self._rep_inflight = None      # (unit, Work) of the one all-reduce across replicas in flight

    # ------------------------------------------------------- the reduction
    def _keep_shard(self, u, out):
        """Keep this rank's shard of the shard group's mean (ZeRO), then start averaging it
        across the replicas (the previous unit's all-reduce finished first)."""
        super()._keep_shard(u, out)
        self._finish_replicas()
        if self.replicate_group.size > 1:
            self._rep_inflight = (u, self.replicate_group.all_reduce(u.shard.grad, op=u.op, async_op=True))

    def _finish_replicas(self):
        if self._rep_inflight is not None:
            u, work = self._rep_inflight
            self._rep_inflight = None
            work.wait()

    def _finish_reductions(self):
        super()._finish_reductions()
        self._finish_replicas()        # every shard's .grad is now the global-batch mean

    # ---------------------------------------------- the step's loss, state
    def reduce_stats(self, v):
        """[loss, *counts]: the loss weighted 1/S and summed over the shard group (ZeRO), then
        weighted 1/R and summed over the replicas; the counts summed over both."""
        v = super().reduce_stats(v)
        if self._rep_aux is None:
            return v
        v = np.array(v, dtype=np.float64)
        v[0] /= self.replicate_group.size
        self._rep_aux.all_reduce(v)
        return v

    def collect(self, items):
        items = super().collect(items)
        if self._rep_aux is None:
            return items
        return [tuple(i) for part in self._rep_aux.all_gather_object(items) for i in part]

    def span_group(self):
        """The dp group when HSDP alone wraps the model (its R x S ranks hold it, each piece
        R times), else the world."""
        if len(self.chain()) == 2:
            return self.dp_group if self.dp_group is not None else comm.get_world()
        return comm.get_world()


__all__ = ["HSDP", "check_hybrid"]
