"""The deterministic mode gives one process's bits on every data-parallel / ZeRO / pipeline /
tensor-parallel layout.

    mpiexec -n 4 python tests/workers/deterministic.py [--steps 20]
    mpiexec -n 8 python tests/workers/deterministic.py [--steps 20]    # dp 2 x tp 2 x pp 2 alone

Ranks 0 and 1 train the float32 and bf16 (fp32 masters) references of the dp cases, ranks 2
and 3 those of the pipeline cases, each ``Local(GPT, deterministic=G)`` on the same global
batches, and send them to every rank.
Then, in float32 and bf16, every layout trains STEPS AdamW steps through the one loop:

* dp 4 (``parallelize(..., deterministic=True)``): microbatches m in {1, 2, 4}, ZeRO 1-3;
* dp 2, on the two halves of the world at once (``DataParallel``/``ZeRO`` over a sub-group;
  half 0 float32, half 1 bf16): m in {1, 2, 4}, ZeRO 1-3;
* pp 2 on the halves (``PipelineParallel`` over a sub-group), every schedule, and dp 2 x pp 2
  (``parallelize``, 1f1b and ZeRO-1 + interleaved), on a 4-layer GPT with G = 4 granules
  (under a pipeline a micro-batch is one granule: dp * m = G);
* tp 2 on the halves (``TensorParallel`` over a sub-group), with and without sequence
  parallelism, and at 8 ranks dp 2 x tp 2 x pp 2 (float32; bf16 with SP), with G = 4.

Each rank compares every piece of its parameters and Adam m, v with ``np.array_equal`` and
reports one line per case. The control: the DEFAULT mode at dp 4, m 2 against the default
one process (m = 1) must NOT give the same bits (the mode is what makes them equal)."""
import argparse

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine import precision
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, Local, MixedPrecision, PipelineParallel, TensorParallel, ZeRO, parallelize
from pdist.testing import check_shards, report
from pdist.training import train

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()
world = comm.init()
assert world.size in (4, 8), "run with 4 ranks (or 8: dp 2 x tp 2 x pp 2)"
B, T, SEED, G = 16, 8, 3, 16
tokens, _ = data.char_dataset(20_000)
cfg = lesson.gpt_config(64, block_size=T, n_layer=2, n_head=2, n_embd=16)
batch = data.batch_fn(tokens, B, T, SEED, cfg.vocab_size)
PRECS = ("fp32", "bf16")


CFG4, G4 = lesson.gpt_config(64, block_size=T, n_layer=4, n_head=2, n_embd=16), 4   # the pipeline cases
GT = 4            # the tensor-parallel cases: 4 granules (each granule's collectives cost the most)


def model_of(prec, c=cfg):
    return GPT(c, SEED) if prec == "fp32" else precision.cast_module(GPT(c, SEED), prec)


def reference(prec, det, m=1, c=cfg):
    """One process: params and Adam m, v by piece name, as full arrays."""
    s = Local(model_of(prec, c), m, deterministic=det)
    s = s if prec == "fp32" else MixedPrecision(s, prec)
    opt = lesson.make_adamw(s.parameters())
    train(s, opt, batch, args.steps)
    out = {k: np.array(v) for k, v in s.full_state_dict().items()}
    for pc in s.pieces():
        for st in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.{st}.{pc.name}"] = np.array(opt.state[id(pc.tensor)][st])
    return out


def compare(name, ref, model):
    opt = lesson.make_adamw(model.parameters())
    train(model, opt, batch, args.steps)
    try:
        n = check_shards(model.sharded_state_dict(opt), ref, lambda nm, st: ref[f"optimizer.{st}.{nm}"],
                         np.array_equal, label=(name,))
        full = model.full_state_dict()
        bad = [k for k in full if not np.array_equal(full[k], ref[k])]
        equal, why = not bad, bad[:3]
    except AssertionError as e:
        equal, why, n = False, str(e)[:300], 0
    report(rank=world.rank, case=name, equal=equal, why=why, pieces=n)


def wrapped(prec, group, zero, m):
    """dp over ``group`` built by hand: DataParallel or ZeRO over Local(deterministic=True)."""
    local = Local(model_of(prec), m, policy=precision.policy_for(prec), deterministic=G)
    s = ZeRO(local, zero, group) if zero else DataParallel(local, group)
    return s if prec == "fp32" else MixedPrecision(s, prec)


def piped(prec, group, schedule):
    """pp over ``group`` built by hand: PipelineParallel over Local(deterministic=G4), m = G4."""
    local = Local(model_of(prec, CFG4), 1, deterministic=G4)
    s = PipelineParallel(local, group, schedule, G4, 2 if schedule == "interleaved" else 1)
    return s if prec == "fp32" else MixedPrecision(s, prec)


def tensor(prec, group, sp):
    """tp 2 over ``group`` built by hand: TensorParallel over Local(deterministic=G), SP or not."""
    s = TensorParallel(Local(model_of(prec), 1, deterministic=GT), group, sequence_parallel=sp)
    return s if prec == "fp32" else MixedPrecision(s, prec)


def dp_tp_pp():
    """8 ranks: dp 2 x tp 2 x pp 2 (parallelize; 1f1b, m = GT / dp; SP in bf16) against one process."""
    mine = reference(PRECS[world.rank], GT) if world.rank < 2 else None   # ranks 0, 1 at once
    ref = [world.broadcast_object(mine, src=r) for r in range(2)]
    mesh = comm.DeviceMesh(dp=2, tp=2, pp=2)
    for prec, r in zip(PRECS, ref):
        model = parallelize(GPT(cfg, SEED), mesh, schedule="1f1b", microbatches=GT // 2, precision=prec,
                            sequence_parallel=prec == "bf16", deterministic=GT)
        compare(f"{prec}.dp2xtp2xpp2" + (".sp" if prec == "bf16" else ""), r, model)


if world.size == 8:
    dp_tp_pp()
    raise SystemExit(0)
LAYOUTS = [(f"m{m}", 0, m) for m in (1, 2, 4)] + [(f"zero{z}", z, 1) for z in (1, 2, 3)]
# the four references at once: ranks 0, 1 the dp cases' (fp32, bf16), ranks 2, 3 the pipeline cases'
mine = reference(PRECS[world.rank % 2], *((G,) if world.rank < 2 else (G4, 1, CFG4)))
refs, refs4 = ([world.broadcast_object(mine, src=r) for r in pair] for pair in ((0, 1), (2, 3)))
mine = reference(PRECS[world.rank], GT) if world.rank < 2 else None     # the tp cases' (4 granules)
refsT = [world.broadcast_object(mine, src=r) for r in (0, 1)]
mesh = comm.DeviceMesh(dp=4)
for prec, ref in zip(PRECS, refs):
    for name, zero, m in LAYOUTS:
        model = parallelize(GPT(cfg, SEED), mesh, zero_stage=zero, microbatches=m, precision=prec,
                            deterministic=G)
        compare(f"{prec}.dp4.{name}", ref, model)
half = world.split(world.rank // 2, name="half")
prec = PRECS[world.rank // 2]
for name, zero, m in LAYOUTS:
    compare(f"{prec}.dp2.{name}", refs[world.rank // 2], wrapped(prec, half, zero, m))
for sp in (False, True):                   # tp 2 on each half (half 0 float32, half 1 bf16), SP or not
    compare(f"{prec}.tp2" + (".sp" if sp else ""), refsT[world.rank // 2], tensor(prec, half, sp))
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
for sched in SCHEDULES:
    compare(f"{prec}.pp2.{sched}", refs4[world.rank // 2], piped(prec, half, sched))
mesh2 = comm.DeviceMesh(dp=2, pp=2)
for prec, ref in zip(PRECS, refs4):
    for name, zero, sched in (("1f1b", 0, "1f1b"), ("zero1.interleaved", 1, "interleaved")):
        model = parallelize(GPT(CFG4, SEED), mesh2, zero_stage=zero, schedule=sched, microbatches=G4 // 2,
                            chunks=2 if sched == "interleaved" else 1, precision=prec, deterministic=G4)
        compare(f"{prec}.dp2xpp2.{name}", ref, model)
ctrl = world.broadcast_object(reference("fp32", False) if world.rank == 0 else None)
compare("control.default.dp4.m2", ctrl, parallelize(GPT(cfg, SEED), mesh, microbatches=2))
