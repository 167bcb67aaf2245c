"""The deterministic mode gives one process's bits on every data-parallel / ZeRO / pipeline /
tensor-parallel / expert-parallel layout.

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
  parallelism, and at 8 ranks dp 2 x tp 2 x pp 2 (float32; bf16 with SP), with G = 4;
* a MoE GPT with G = 4 (``experts``): dp 2 x ep 2 on the halves (ZeRO 0 and 3), dp 4 x ep 2
  with ZeRO-1.
* tp_blocks = 4 (``deterministic=dict(granules=2, tp_blocks=4)``, a 4-head GPT): tp 2 on the
  halves (float32 with SP, bf16 without) and tp 4 on the world (float32 with and without SP,
  bf16 with SP), against one process computing 4 blocks;
* Llama (GQA 8 query / 4 key-value heads, SwiGLU, RoPE, RMSNorm, untied), G = 2: tp 2 on the
  halves with tp_blocks = 2 (float32 with SP, bf16 without) and tp 4 on the world with
  tp_blocks = 4 (float32; bf16 with SP). These run half the steps (the induction).
* Ulysses cp 2 on the halves and dp 2 x cp 2 on the world (float32, bf16; ZeRO-2 in float32),
  ``deterministic=dict(granules=4, cp_chunks=2)``, against one process with cp_chunks = 2 (ranks
  0, 1 train it while ranks 2, 3 train MoE's), the run's steps.

Each rank compares every piece of its parameters and Adam m, v with ``np.array_equal`` and
reports one line per case. The controls: the DEFAULT mode at dp 4, m 2 against the default
one process (m = 1), and at dp 4 x ep 2 (MoE) against the default one process with m = 4 (the
same drops), must NOT give the same bits (the mode is what makes them equal). (That one process
without cp_chunks does not give the cp cases' bits: tests/test_deterministic.py, one process.)"""
import argparse

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine import precision
from pdist.models import registry
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, ExpertParallel, Local, MixedPrecision, PipelineParallel, TensorParallel, ZeRO, parallelize
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
CFGE, GE = lesson.gpt_config(64, block_size=T, n_layer=2, n_head=2, n_embd=16, n_expert=4, expert_top_k=2,
                             capacity_factor=1.0, router_aux_loss_coef=0.01), 4   # the MoE / ep cases
GT = 4            # the tensor-parallel cases: 4 granules (each granule's collectives cost the most)
CFGH = lesson.gpt_config(64, block_size=T, n_layer=2, n_head=4, n_embd=16)          # tp 4: 4 heads
CFGL = lesson.gpt_config(64, model="llama", block_size=T, n_layer=2, n_head=8, n_embd=32)   # n_kv_head 4
G2, S2 = 2, min(2, args.steps)    # the tp_blocks = 4 and Llama tp cases (beyond the grid): 2 granules, 2 steps
# cp 2 (Ulysses), part of the grid: 4 granules x 2 token chunks, the run's steps (20 in the test:
# ~17 CPU-s on 2 cores at load 2.6; 2 steps already catch a wrong leaf order in float32)
DETC, SC = dict(granules=GT, cp_chunks=2), args.steps
B4 = dict(granules=G2, tp_blocks=4)     # a dict: each Local gets its own policy


def model_of(prec, c=cfg):
    m = GPT(c, SEED) if c.__class__ is cfg.__class__ else registry.build(c, SEED)
    return m if prec == "fp32" else precision.cast_module(m, prec)


def reference(prec, det, m=1, c=cfg, steps=None):
    """One process: params and Adam m, v by piece name, as full arrays."""
    s = Local(model_of(prec, c), m, deterministic=det)
    s = s if prec == "fp32" else MixedPrecision(s, prec)
    opt = lesson.make_adamw(s.parameters())
    train(s, opt, batch, steps or args.steps)
    out = {k: np.array(v) for k, v in s.full_state_dict().items()}
    for pc in s.pieces():
        for st in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.{st}.{pc.name}"] = np.array(opt.state[id(pc.tensor)][st])
    return out


def compare(name, ref, model, steps=None, drops=False):
    opt = lesson.make_adamw(model.parameters())
    train(model, opt, batch, steps or args.steps)
    full = model.full_state_dict()      # a collective: every rank, before a local mismatch can skip it (a hang)
    extra = {"dropped": sum(s["dropped"] for s in model.find(ExpertParallel).moe_stats().values())} if drops else {}
    try:
        n = check_shards(model.sharded_state_dict(opt), ref, lambda nm, st: ref[f"optimizer.{st}.{nm}"],
                         np.array_equal, label=(name,))
        bad = [k for k in full if not np.array_equal(full[k], ref[k])]
        equal, why = not bad, bad[:3]
    except AssertionError as e:
        equal, why, n = False, str(e)[:300], 0
    report(rank=world.rank, case=name, equal=equal, why=why, pieces=n, **extra)


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


def tensor(prec, group, sp, c=cfg, det=GT):
    """tp over ``group`` built by hand: TensorParallel over Local(deterministic=det), SP or not."""
    s = TensorParallel(Local(model_of(prec, c), 1, deterministic=det), group, sequence_parallel=sp)
    return s if prec == "fp32" else MixedPrecision(s, prec)


def experts(refsE, half):
    """ep 2: on the halves (dp 2 x ep 2, and with ZeRO-3: float32 on half 0, bf16 on half 1), and at dp 4 x ep 2 with
    ZeRO-1 in both precisions, a MoE GPT (top-2 of 4 experts, capacity 1.0, aux loss) against one
    process; the control: the default mode at dp 4 x ep 2 does NOT give one process's bits."""
    prec, mesh2 = PRECS[world.rank // 2], comm.DeviceMesh(dp=2, ep=2, world=half)
    for zero in (0, 3):
        model = parallelize(GPT(CFGE, SEED), mesh2, zero_stage=zero, precision=prec, deterministic=GE)
        compare(f"{prec}.ep2" + (".zero3" if zero else ""), refsE[world.rank // 2], model, drops=not zero)
    mesh4 = comm.DeviceMesh(dp=4, ep=2)
    for prec, ref in zip(PRECS, refsE):
        model = parallelize(GPT(CFGE, SEED), mesh4, zero_stage=1, precision=prec, deterministic=GE)
        compare(f"{prec}.dp4xep2.zero1", ref, model)
    ctrl = world.broadcast_object(reference("fp32", False, 4, CFGE) if world.rank == 0 else None)   # same drops
    compare("control.default.dp4xep2", ctrl, parallelize(GPT(CFGE, SEED), mesh4))


def context(refsC, half):
    """cp 2 (Ulysses) on the halves (half 0 float32, half 1 bf16), dp 2 x cp 2 on the world (float32,
    bf16; ZeRO-2 in float32), against one process with cp_chunks = 2 (the chunks' leaves)."""
    def cp(mesh, prec, zero=0):
        return parallelize(GPT(cfg, SEED), mesh, zero_stage=zero, precision=prec, context_parallel="ulysses",
                           deterministic=DETC)
    prec = PRECS[world.rank // 2]
    compare(f"{prec}.cp2", refsC[world.rank // 2], cp(comm.DeviceMesh(cp=2, world=half), prec), SC)
    mesh = comm.DeviceMesh(dp=2, cp=2)
    for prec, ref in zip(PRECS, refsC):
        compare(f"{prec}.dp2xcp2", ref, cp(mesh, prec), SC)
    compare("fp32.dp2xcp2.zero2", refsC[0], cp(mesh, "fp32", 2), SC)


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
# the tp cases' (4 granules): ranks 0, 1 GPT's (tp_blocks 2, then 4 with 4 heads), ranks 2, 3 Llama's
mine = reference(PRECS[world.rank % 2], *((GT, 1, cfg) if world.rank < 2 else (G2, 1, CFGL, S2)))
refsT, refsL = ([world.broadcast_object(mine, src=r) for r in pair] for pair in ((0, 1), (2, 3)))
mine = reference(PRECS[world.rank % 2], B4, 1, (CFGH, CFGL)[world.rank // 2], S2)
refsH, refsL4 = ([world.broadcast_object(mine, src=r) for r in pair] for pair in ((0, 1), (2, 3)))
# MoE's (ranks 2, 3) and cp 2's (ranks 0, 1: one process with cp_chunks = 2)
mine = reference(PRECS[world.rank % 2], *((GE, 1, CFGE) if world.rank >= 2 else (DETC, 1, cfg, SC)))
refsE, refsC = ([world.broadcast_object(mine, src=r) for r in pair] for pair in ((2, 3), (0, 1)))
mesh = comm.DeviceMesh(dp=4)
for prec, ref in zip(PRECS, refs):
    for name, zero, m in LAYOUTS:
        model = parallelize(GPT(cfg, SEED), mesh, zero_stage=zero, microbatches=m, precision=prec,
                            deterministic=G)
        compare(f"{prec}.dp4.{name}", ref, model)
half = world.split(world.rank // 2, name="half")
experts(refsE, half)
context(refsC, half)
prec = PRECS[world.rank // 2]
for name, zero, m in LAYOUTS:
    compare(f"{prec}.dp2.{name}", refs[world.rank // 2], wrapped(prec, half, zero, m))
for sp in (False, True):                   # tp 2 on each half (half 0 float32, half 1 bf16), SP or not
    compare(f"{prec}.tp2" + (".sp" if sp else ""), refsT[world.rank // 2], tensor(prec, half, sp))
sp = prec == "fp32"                        # tp 2 with tp_blocks = 4, and Llama: float32 with SP, bf16 without
compare(f"{prec}.tp2.b4" + (".sp" if sp else ""), refsH[world.rank // 2], tensor(prec, half, sp, CFGH, B4), S2)
compare(f"{prec}.llama.tp2" + (".sp" if sp else ""), refsL[world.rank // 2], tensor(prec, half, sp, CFGL, G2), S2)
for pr, ref, refL in zip(PRECS, refsH, refsL4):     # tp 4 on the world, tp_blocks = 4 (bf16 without SP: tp2.b4)
    for sp in (False, True) if pr == "fp32" else (True,):
        compare(f"{pr}.tp4" + (".sp" if sp else ""), ref, tensor(pr, world, sp, CFGH, B4), S2)
    compare(f"{pr}.llama.tp4" + (".sp" if pr == "bf16" else ""), refL, tensor(pr, world, pr == "bf16", CFGL, B4),
            S2)
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
