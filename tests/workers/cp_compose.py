"""Context parallelism composed with tp (+SP), pp, ZeRO and low precision equals one process.

    mpiexec -n 4 python tests/workers/cp_compose.py     # cp2 x tp2 (+SP), cp2 x pp2 (every schedule),
                                                        # cp2 x dp2 ZeRO-1/2/3, bf16 and fp16
    mpiexec -n 8 python tests/workers/cp_compose.py     # cp2 x dp2 x tp2, cp2 x tp2 x pp2, cp4 x tp2

Every layout of the world size runs in this one launch. Each case: K AdamW steps of
``parallelize(..., context_parallel=)`` on GPT-2 or Llama against one process on the same
global batches. fp32 (float64 compute): every loss, every piece of every parameter and of
Adam's m, v (rtol 1e-9) and ``full_state_dict``. Every step, every rank holds B/dp rows of
T/cp tokens, and the bytes its cp group sent are the formula's with this tp rank's heads:
ring, per attention layer of its stage, (cp - 1) K/V chunks of n_kv_head/tp heads forward
and twice that backward (``ring_bytes``); Ulysses, four all-to-alls each way of (cp - 1)/cp
of the (B, T/cp, heads/tp) arrays (``ulysses_bytes``), exactly. bf16/fp16: against one
process in the same precision running dp micro-batches (``MixedPrecision(Local(..., dp))``);
not bit for bit: a cp rank's weight gradient is a partial sum over its tokens, rounded to the
low dtype before the fp32 sum over dp x cp, where one process rounds the whole micro-batch's
sum once. So the claim is the rounding's: the first step's synchronized gradient, every
piece, within GRAD_TOL (a few low-dtype ulps of the tensor's largest element), every loss to
rtol 1e-3, and fp16's scaler in the same state. (Masters are not compared: Adam turns an
ulp in a near-zero gradient into a whole lr step.) A checkpoint saved at cp2 x tp2 loads at
cp2 x dp2 ZeRO-3 and at one process and continues equal to the uninterrupted run. The refusals raise on every rank."""
import os
import shutil
import tempfile

import numpy as np

from pdist import checkpoint, comm, data
from pdist.course import lesson
from pdist.engine import precision
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.engine.grad_scaler import GradScaler
from pdist.models.gpt import GPT
from pdist.models.llama import Llama, LlamaConfig
from pdist.optim import AdamW
from pdist.parallel import Local, MixedPrecision, parallelize
from pdist.parallel.context import MODES, ContextParallel
from pdist.parallel.context.ring_attention import ring_bytes
from pdist.parallel.context.ulysses import ulysses_bytes
from pdist.parallel.layout import box_slices
from pdist.parallel.zero import ZeRO
from pdist.testing import check_shards, report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
N, B, T, SEED, STEPS = world.size, 4, 16, 3, 2
TOL = dict(rtol=1e-9, atol=1e-12)
GRAD_TOL = 2.0 ** -6                   # bf16/fp16: relative to the tensor's largest |gradient| (docstring)
tokens, _ = data.char_dataset(20_000)
batch = data.batch_fn(tokens, B, T, SEED, 96)


def config(name, n_layer):
    if name == "gpt2":      # 4 heads: tp 2 x cp 2 leaves one head per rank under Ulysses
        return lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=n_layer, n_head=4, n_embd=16)
    return LlamaConfig(vocab_size=96, block_size=T, n_layer=n_layer, n_head=8, n_kv_head=4, n_embd=32,
                       intermediate_size=32, dtype="float64")       # GQA: 2 query heads per kv head


def make_opt(params):
    return AdamW(params, lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS, weight_decay=lesson.WEIGHT_DECAY)


def scaler(prec):
    return GradScaler(init_scale=2.0 ** 8) if prec == "fp16" else None


_refs = {}


def reference(name, n_layer, prec, dp):
    """One process: (losses, state_dict, state(name, key), {name: step 0's gradient}); low
    precision with dp micro-batches (the fp32 masters' gradients)."""
    key = (name, n_layer, prec, dp if prec != "fp32" else 1)
    if key in _refs:
        return _refs[key]
    cls = GPT if name == "gpt2" else Llama
    if prec == "fp32":
        m = Local(cls(config(name, n_layer), SEED))
    else:
        m = MixedPrecision(Local(precision.cast_module(cls(config(name, n_layer), SEED), prec), dp), prec,
                           scaler(prec))
    opt, losses, grads = make_opt(m.parameters()), [], {}
    for step in range(STEPS):
        losses.append(m.forward_backward(*m.local_batch(*batch(step)), step=step))
        grads = grads or {pc.name: to_numpy(pc.tensor.grad).copy() for pc in m.pieces()}
        opt.step()
        opt.zero_grad()
    pieces = {pc.name: pc.tensor for pc in m.pieces()}
    _refs[key] = (losses, m.full_state_dict(), lambda n, s: opt.state[id(pieces[n])][s], grads,
                  getattr(m, "scaler", None))
    return _refs[key]


def check_grads(model, ref_grads):
    """Low precision, after step 0's sync: every piece of every gradient within GRAD_TOL."""
    n = 0
    for pc in model.pieces():
        if pc.tensor.grad is None or not pc.tensor.grad.size:
            continue
        got, want = to_numpy(pc.view(pc.tensor.grad)), ref_grads[pc.name][box_slices(pc)]
        bound = GRAD_TOL * np.abs(ref_grads[pc.name]).max()
        assert np.abs(got - want).max() <= bound, (pc.name, pc.offsets, np.abs(got - want).max(), bound)
        worst[0] = max(worst[0], float(np.abs(got - want).max() / bound))
        n += 1
    return n


worst = [0.0]       # the largest gradient difference seen, as a fraction of its bound


def cp_bytes(cfg, mode, dp, tp, pp, cp):
    """What this rank's cp group sends per step: the formula per attention layer of its stage,
    with this tp rank's heads (n_head/tp, n_kv_head/tp), on its B/dp rows (all micro-batches)."""
    hs = cfg.n_embd // cfg.n_head
    nh, nkv = cfg.n_head // tp, getattr(cfg, "n_kv_head", cfg.n_head) // tp
    if MODES[mode][0] == "ring":
        f, b = ring_bytes(B // dp, T, cp, nkv, hs, 8)
    else:
        f, b = ulysses_bytes(B // dp, T, cp, nh, nkv, hs, 8)
    return (cfg.n_layer // pp) * (f + b)


_meshes = {}


def mesh_of(dp, cp, tp, pp, rep=1):
    """One DeviceMesh per shape for all its cases (its group splits are collectives: paid once);
    ``rep`` > 1: HSDP's dp_replicate (dp_shard = dp / rep)."""
    if (dp, cp, tp, pp, rep) not in _meshes:
        _meshes[dp, cp, tp, pp, rep] = comm.DeviceMesh(dp_replicate=rep, dp_shard=dp // rep, cp=cp, tp=tp, pp=pp)
    return _meshes[dp, cp, tp, pp, rep]


def train_case(name, mode, dp=1, tp=1, pp=1, sp=False, zero=0, schedule="1f1b", chunks=1, mb=1, prec="fp32",
               n_layer=2, rep=1):
    """K steps of one layout against one process; asserts rows, tokens and bytes every step.
    ``rep`` > 1: HSDP, ZeRO over dp/rep x cp ranks and ``rep`` replicas (dp_replicate)."""
    cp = N // (dp * tp * pp)
    cfg, cls = config(name, n_layer), (GPT if name == "gpt2" else Llama)
    mesh = mesh_of(dp, cp, tp, pp, rep)
    model = parallelize(cls(cfg, SEED), mesh, zero_stage=zero, sequence_parallel=sp, schedule=schedule,
                        chunks=chunks, microbatches=mb, context_parallel=mode, precision=prec, scaler=scaler(prec))
    opt, losses, sent, ref = make_opt(model.parameters()), [], [], reference(name, n_layer, prec, dp)
    want_bytes, label = cp_bytes(cfg, mode, dp, tp, pp, cp), (name, mode, dp, tp, pp, sp, zero, schedule, prec)
    for step in range(STEPS):
        x, y = model.local_batch(*batch(step))
        held = model.find(ContextParallel).local_shape
        assert x.shape == (B // dp, T // cp) == held, (x.shape, dp, cp)   # B/dp rows, T/cp tokens
        mesh.cp_group.reset_stats()
        losses.append(model.forward_backward(x, y, step=step))
        sent.append(mesh.cp_group.bytes_sent())
        assert sent[-1] == want_bytes, (label, sent, want_bytes)
        if prec != "fp32" and step == 0:
            checked = check_grads(model, ref[3])
        opt.step()
        opt.zero_grad()
    np.testing.assert_allclose(losses, ref[0], rtol=1e-9 if prec == "fp32" else 1e-3, err_msg=str(label))
    if prec == "fp32":
        checked = check_shards(model.sharded_state_dict(opt), ref[1], ref[2], close, label)
        full = model.full_state_dict()       # gathered over every rank: one process's state_dict
        assert sorted(full) == sorted(ref[1]) and all(close(full[k], ref[1][k]) for k in ref[1]), label
    elif ref[4] is not None:
        assert model.scaler.state_dict() == ref[4].state_dict(), (model.scaler.state_dict(), ref[4].state_dict())
    report(case="train", model=name, mode=mode, dp=dp, cp=cp, tp=tp, pp=pp, sp=sp, zero=zero, schedule=schedule,
           chunks=chunks, precision=prec, rank=world.rank, pieces=checked, bytes=sent, want_bytes=want_bytes,
           coords=[mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.tp_rank], grad_worst=worst[0], rep=rep,
           chain=[type(s).__name__ for s in model.chain()],
           shard_group=model.find(ZeRO).group.size if model.find(ZeRO) else None)
    worst[0] = 0.0


def close(a, b):
    return np.allclose(to_numpy(a), to_numpy(b), **TOL)


def refused(fn, *needles):
    try:
        fn()
    except ValueError as e:
        assert all(s in str(e) for s in needles), (str(e), needles)
        report(case="refused", rank=world.rank, message=str(e))
        return
    raise AssertionError(f"not refused: {needles}")


def ckpt_case():
    """A checkpoint saved at cp2 x tp2 (zigzag, SP) loads at cp2 x dp2 (Ulysses, ZeRO-3) and at
    one process, and each continues equal to the uninterrupted run (float64, rtol 1e-9)."""
    cfg = config("gpt2", 2)
    whole = Local(GPT(cfg, SEED))
    want = train(whole, make_opt(whole.parameters()), batch, STEPS + 1)       # uninterrupted
    want_sd = whole.full_state_dict()
    tmp = world.broadcast_object(tempfile.mkdtemp(prefix="pdist-cp-ckpt-") if world.rank == 0 else None)
    path = os.path.join(tmp, "step")
    try:
        a = parallelize(GPT(cfg, SEED), mesh_of(1, 2, 2, 1), sequence_parallel=True, context_parallel="ring-zigzag")
        opt = make_opt(a.parameters())
        train(a, opt, batch, STEPS)
        checkpoint.save(a, opt, path, STEPS)
        for name, m in (("cp2 x dp2, ulysses, zero 3", parallelize(GPT(cfg, SEED), mesh_of(2, 2, 1, 1), zero_stage=3,
                                                                   context_parallel="ulysses")),
                        ("one process", Local(GPT(cfg, SEED)))):
            opt = make_opt(m.parameters())
            step, _ = checkpoint.load(m, opt, path)
            losses = train(m, opt, batch, STEPS + 1 - step, start=step)
            np.testing.assert_allclose(losses, want[step:], **TOL, err_msg=name)
            full = m.full_state_dict()
            assert step == STEPS and all(close(full[k], want_sd[k]) for k in want_sd), name
            report(case="checkpoint", layout=name, rank=world.rank, step=step, losses=losses)
    finally:
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(tmp)          # the directory this case made


def cases_4():
    for name, mode, sp in (("gpt2", "ring", False), ("llama", "ring", True), ("gpt2", "ring-zigzag", True),
                           ("llama", "ring-zigzag", False), ("gpt2", "ulysses", True), ("llama", "ulysses", False)):
        train_case(name, mode, tp=2, sp=sp)                                        # cp2 x tp2 (+SP)
    for name, mode, schedule, chunks in (("gpt2", "ring", "1f1b", 1), ("llama", "ring-zigzag", "gpipe", 1),
                                         ("gpt2", "ulysses", "interleaved", 2), ("llama", "ring", "zb-h1", 1),
                                         ("gpt2", "ring-zigzag", "zb-v", 2), ("llama", "ulysses", "dualpipev", 2)):
        train_case(name, mode, pp=2, schedule=schedule, chunks=chunks, mb=2, n_layer=2 * chunks)   # cp2 x pp2
    train_case("llama", "ring-zigzag", dp=2, zero=2)          # cp2 x dp2 ZeRO-2, ZeRO-3 (ZeRO-1, ring
    train_case("gpt2", "ulysses", dp=2, zero=3)               # ZeRO-3: tests/workers/context_parallel.py)
    train_case("gpt2", "ring-zigzag", dp=2, zero=1, prec="bf16")
    train_case("gpt2", "ring", dp=2, zero=2, rep=2)           # HSDP: 2 replicas of a cp2 shard group
    train_case("llama", "ring", tp=2, sp=True, prec="fp16")
    llama_kv2 = LlamaConfig(vocab_size=96, block_size=T, n_layer=1, n_head=4, n_kv_head=2, n_embd=16,
                            dtype="float64")
    refused(lambda: parallelize(Llama(llama_kv2, SEED), mesh_of(1, 2, 2, 1), context_parallel="ulysses"),
            "n_kv_head = 2", "tp = 2", "per tp rank", "context_parallel='ring'")
    m = parallelize(GPT(config("gpt2", 1), SEED), mesh_of(1, 2, 2, 1), sequence_parallel=True,
                    context_parallel="ring")
    refused(lambda: m.local_batch(*data.batch_fn(tokens, B, 6, SEED, 96)(0)), "T/cp = 3", "multiple of 4")
    ckpt_case()


def cases_8():
    train_case("gpt2", "ring-zigzag", dp=2, tp=2, sp=True, zero=1)                # cp2 x dp2 x tp2
    train_case("llama", "ulysses", dp=2, tp=2, zero=3)
    train_case("llama", "ulysses", dp=4, zero=3, rep=2)                           # HSDP 2 x (2 x cp2)
    train_case("llama", "ring", tp=2, pp=2, sp=True, mb=2)                         # cp2 x tp2 x pp2
    train_case("gpt2", "ring-zigzag", tp=2, sp=True)                               # cp4 x tp2


{4: cases_4, 8: cases_8}[N]()
