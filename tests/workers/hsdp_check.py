"""HSDP (pdist/parallel/zero/hsdp.py): its mesh, its bytes per group, and what it refuses.

    mpiexec -n 4 python tests/workers/hsdp_check.py            # dp_replicate 2 x dp_shard 2
    mpiexec -n 8 python tests/workers/hsdp_check.py --tp 2     # the same, x tp 2

* mesh: the rank order (dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank), each group's
  world ranks; DeviceMesh(dp=4) is dp_shard 4; zero_stage 0 is DDP over the whole dp group;
  dp_replicate 1 is ZeRO;
* bytes: for stages 1-3 (GPT-2, float64), the second step's bytes on the shard group and on the
  replicate group (ProcessGroup.stats) against the formulas (ZeRO's with N = S inside, 2(R-1)/R
  b Ψ_pad/S across) and against pdist.plan's ``dp`` and ``dp_rep`` for the same layout; at 4 ranks
  also under context parallelism (2 replicas of a dp_shard 1 x cp 2 shard group, stage 2);
* refusals (a mixture of experts, the deterministic mode, a dp that disagrees, ZeRO-3 x pp, stage 0):
  each bad input raises the same ValueError on every rank before any collective.
Reports one JSON object per case and rank (pdist.testing.report).
"""
import argparse

from pdist import comm, data
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import Local, parallelize
from pdist.parallel.data_parallel import DataParallel
from pdist.parallel.zero import HSDP, ZeRO
from pdist.plan import plan
from pdist.plan.measured import layout_of
from pdist.testing import report
from pdist.training import train

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1)
ARGS = p.parse_args()
set_default_dtype("float64")
world = comm.init()
R, S, TP, B, T, SEED, b = 2, 2, ARGS.tp, 8, 8, 3, 8
tokens, _ = data.char_dataset(20_000)
cfg = lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=2, n_head=4, n_embd=32)
batch = data.batch_fn(tokens, B, T, SEED, cfg.vocab_size)


def out(case, **kw):
    report(rank=world.rank, case=case, **kw)


def check_mesh():
    m = comm.DeviceMesh(dp_replicate=R, dp_shard=S, tp=TP)
    assert (m.dp_world_size, m.dp_replicate_world_size, m.dp_shard_world_size) == (R * S, R, S), m
    assert m.dp_rank == m.dp_replicate_rank * S + m.dp_shard_rank, m
    assert world.rank == m.dp_rank * TP + m.tp_rank, m                  # tp fastest, then dp_shard, then dp_replicate
    assert m.dp_shard_group.ranks == [m.rank_of(dp=m.dp_replicate_rank * S + s, tp=m.tp_rank) for s in range(S)]
    assert m.dp_replicate_group.ranks == [m.rank_of(dp=r * S + m.dp_shard_rank, tp=m.tp_rank) for r in range(R)]
    plain = comm.DeviceMesh(dp=R * S, tp=TP)
    assert (plain.dp_replicate_world_size, plain.dp_shard_world_size) == (1, R * S)
    assert plain.dp_shard_group is plain.dp_group and plain.dp_replicate_group.size == 1
    same = comm.DeviceMesh(dp=R * S, dp_shard=S, tp=TP)                 # dp and a split that agree
    assert (same.dp_replicate_world_size, same.dp_shard_world_size) == (R, S)
    ddp = parallelize(GPT(cfg, SEED), m, zero_stage=0)                   # stage 0: DDP over all of dp
    assert isinstance(ddp, DataParallel) and ddp.group.size == R * S, ddp.chain()
    zero = parallelize(GPT(cfg, SEED), comm.DeviceMesh(dp_replicate=1, dp_shard=R * S, tp=TP), zero_stage=2)
    assert type(zero) is ZeRO and zero.group.size == R * S
    out("mesh", shard_ranks=m.dp_shard_group.ranks, replicate_ranks=m.dp_replicate_group.ranks)


def check_bytes(stage, cp=1):
    """The second step's bytes per group (the first has no all-gather of updated parameters). With
    ``cp`` = 2 (ring attention): dp_shard 1, the shard group is the cp pair (dp_shard x cp)."""
    S_ = S // cp
    m = comm.DeviceMesh(dp_replicate=R, dp_shard=S_, tp=TP, cp=cp)
    model = parallelize(GPT(cfg, SEED), m, zero_stage=stage, sequence_parallel=TP > 1,
                        context_parallel="ring" if cp > 1 else None)
    opt = AdamW(model.parameters(), lr=lesson.LR)
    hsdp = model.find(HSDP)
    assert hsdp is not None and hsdp.group is m.dp_shard_cp_group and hsdp.replicate_group is m.dp_replicate_group
    assert hsdp.group.size == S_ * cp
    groups = {"shard": m.dp_shard_cp_group, "replicate": m.dp_replicate_group}
    train(model, opt, batch, 1)
    for g in groups.values():
        g.reset_stats()
    train(model, opt, batch, 1, start=1)
    sent = {k: g.bytes_sent() for k, g in groups.items()}
    pad = hsdp.numel_padded                                              # Ψ_pad = Σ_units ceil(Ψ_u/S)·S, per tp rank
    want = {"shard": (2 if stage < 3 else 3) * (S - 1) / S * b * pad, "replicate": 2 * (R - 1) / R * b * pad / S}
    planned = plan(cfg, "a100", dp=R * S_, cp=cp, tp=TP, zero=stage, shard=S, sp=TP > 1, m=1,
                   micro_batch=B // (R * S_), precision="fp64")["memory_per_stage"][0]["comm_bytes"]
    planned = {"shard": planned["dp"], "replicate": planned["dp_rep"]}
    lay, read = layout_of(model, (B, T))[1:] if cp == 1 else (None, {})   # the measured planner's reading
    out(f"bytes stage {stage}" + (f" cp {cp}" if cp > 1 else ""), sent=sent, want=want, planned=planned, padded=pad, units=len(hsdp.units),
        ops={k: sorted(g.stats) for k, g in groups.items()},
        read=lay and {"dp": lay.dp, "shard": lay.shard, "zero": lay.zero,
                      "groups": {k: g.ranks for k, g in read.items() if k in ("dp", "dp_rep")}},
        groups={"shard": m.dp_shard_cp_group.ranks, "replicate": m.dp_replicate_group.ranks})


def refused(case, make):
    """``make()`` must raise ValueError (or TypeError) here, on every rank, before any collective."""
    try:
        make()
    except (ValueError, TypeError) as e:
        out(case, error=f"{type(e).__name__}: {e}")
        return
    out(case, error=None)


def check_refusals():
    moe = lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=2, n_head=4, n_embd=32, n_expert=4)
    refused("dp disagrees", lambda: comm.DeviceMesh(dp=R * S, dp_replicate=R, dp_shard=S + 1, tp=TP))
    refused("experts", lambda: parallelize(GPT(moe, SEED), comm.DeviceMesh(dp_replicate=R, dp_shard=S, tp=TP),
                                           zero_stage=1))
    refused("deterministic", lambda: parallelize(GPT(cfg, SEED), comm.DeviceMesh(dp_replicate=R, dp_shard=S, tp=TP),
                                                 zero_stage=1, deterministic=True))
    refused("zero-3 x pp", lambda: parallelize(GPT(cfg, SEED), comm.DeviceMesh(dp_replicate=R, dp_shard=1, pp=S,
                                                                                tp=TP), zero_stage=3))
    m = comm.DeviceMesh(dp_replicate=R, dp_shard=S, tp=TP)
    refused("stage 0", lambda: HSDP(GPT(cfg, SEED), 0, m.dp_shard_group, m.dp_replicate_group))
    refused("mode", lambda: HSDP(Local(GPT(cfg, SEED), deterministic=True), 1, m.dp_shard_group,
                                 m.dp_replicate_group))             # built by hand around a chain in a mode


check_mesh()
for stage in (1, 2, 3):
    check_bytes(stage)
if TP == 1:
    check_bytes(2, cp=2)
check_refusals()
