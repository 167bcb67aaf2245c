"""Mixed precision under data parallelism and ZeRO equals one process in the same precision.

    mpiexec -n 4 python tests/workers/precision_equiv.py --precision bf16 --zero 2

K AdamW steps through the one loop on a ``parallelize``d GPT (dp = N, ``--tp`` t, ``--zero`` stage,
bf16 or fp16 parameters, fp32 masters, compute in float64) against one process,
``MixedPrecision(Local(GPT, microbatches=N))``, on the same global batches.

Why bit-for-bit: rank r's rows are micro-batch r of the single process, so its
forward and backward are the same BLAS calls on the same arrays, and give the same
gradient, rounded once to the low dtype; both then sum the N of them in float32, in
the order r = 0..N-1, divide by N and round once (the comm's two-phase reduction vs
GradAccumulator). From there the
fp32 master update is elementwise. So: masters, Adam m and v (every piece) and the
low-precision weights equal exactly (``array_equal``); the losses (float64, summed in
other orders) to rtol 1e-12. Also checked: the memory by category is the paper's
mixed-precision formula, with Ψ = Σ units Ψ_pad, and bytes sent are 2 per element.

``--each=A;B;...`` runs several layouts of this world size in one launch (one start-up of
mpiexec and of the imports; the single-process reference is trained once per precision and
N); each report carries ``case``, and an error in a layout is re-raised naming it."""
import argparse

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.measure import memory
from pdist.engine import precision
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.engine.grad_scaler import GradScaler
from pdist.parallel import Local, MixedPrecision, parallelize
from pdist.parallel.base import ParallelModule
from pdist.testing import each_case, check_shards, report
from pdist.training import train

p = argparse.ArgumentParser()
p.add_argument("--precision", default="bf16")
p.add_argument("--zero", type=int, default=0)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--naive", action="store_true")
p.add_argument("--tp", type=int, default=1)
p.add_argument("--each", default=None, help="several layouts, ';'-separated, each run in turn (one launch)")
ARGS = p.parse_args()
set_default_dtype("float64")
world = comm.init()
B, T, SEED = 8, 8, 3
tokens, tok = data.char_dataset(50_000)
cfg = lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=2, n_head=4, n_embd=32)
batch = data.batch_fn(tokens, B, T, SEED, cfg.vocab_size)
_REFERENCES = {}


def scaler(args):
    """fp16: a scale at which this small model's gradients do not overflow (at the default 2^16
    both sides skip the same first steps: rank r and micro-batch r hold the same S g_r)."""
    return GradScaler(init_scale=2.0 ** 8) if args.precision == "fp16" else None


def reference(args, N):
    """One process on the same global batches, N micro-batches (trained once per precision, N, steps)."""
    key = (args.precision, N, args.steps)
    if key not in _REFERENCES:
        ref = MixedPrecision(Local(precision.cast_module(GPT(cfg, SEED), args.precision), microbatches=N),
                             args.precision, scaler(args))
        ref_opt = lesson.make_adamw(ref.parameters())
        ref_losses = train(ref, ref_opt, batch, args.steps)
        _REFERENCES[key] = (ref, ref_opt, ref_losses, ref.full_state_dict(), {pc.name: pc for pc in ref.pieces()})
    return _REFERENCES[key]


def check_memory(model, opt, dp, args, N):
    """Memory by category: the paper's mixed-precision formulas (ZeRO pads Ψ: Σ_units Ψ_pad)."""
    row = memory.model_state_bytes(model, opt)
    psi = dp.numel_padded if args.zero else sum(q.size for q in dp.parameters())
    want = {0: (2 * psi, 2 * psi, 12 * psi), 1: (2 * psi, 2 * psi, 12 * psi // N),
            2: (2 * psi, 2 * psi // N, 12 * psi // N), 3: (2 * psi // N, 2 * psi // N, 12 * psi // N)}[args.zero]
    got = (row["params_bytes"], row["grads_bytes"], row["optim_bytes"])
    assert got == want and row["master_bytes"] * 3 == row["optim_bytes"], (got, want, row)
    return row, psi


def run(args, case):
    N = world.size // args.tp                                # N: the data-parallel size
    ref, ref_opt, ref_losses, ref_sd, ref_pieces = reference(args, N)
    mesh = comm.DeviceMesh(dp=N, tp=args.tp)
    model = parallelize(GPT(cfg, SEED), mesh, zero_stage=args.zero, precision=args.precision, scaler=scaler(args),
                        data_parallel="naive" if args.naive else "bucketed")
    opt = lesson.make_adamw(model.parameters())
    dp = model.find(ParallelModule)                       # the outermost parallel strategy: DP or ZeRO
    dp.group.reset_stats()
    losses = train(model, opt, batch, args.steps)
    sent = dp.group.bytes_sent() / args.steps
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=0, err_msg="losses")
    if model.scaler is not None:
        assert model.scaler.state_dict() == ref.scaler.state_dict() and model.scaler.get_scale() == 2.0 ** 8
    row, psi = check_memory(model, opt, dp, args, N)
    same = exact if args.tp == 1 else close
    checked = check_shards(model.sharded_state_dict(opt), ref_sd,
                           lambda name, state: ref_opt.state[id(ref_pieces[name].tensor)][state], same)
    full = model.full_state_dict()
    assert all(same(full[k], ref_sd[k]) for k in ref_sd), [k for k in ref_sd if not same(full[k], ref_sd[k])]
    # the low-precision weights the next forward reads: the masters rounded, on both sides
    model.zero_grad(), ref.zero_grad()          # refresh: w <- round(W), then ZeRO-1/2 all-gather
    low = {n: p.data for n, p in ref.module.named_parameters()}
    for n, p in model.module.named_parameters():
        if p.data.size:
            want = low[n][tuple(slice(0, d) for d in p.shape)] if args.tp == 1 else None    # (tp: shards)
            assert p.dtype == precision.low_dtype(args.precision), n
            assert want is None or np.array_equal(p.data, want), n
    report(rank=world.rank, case=case, checked_pieces=checked, memory=row, psi=psi, sent_per_step=sent, losses=losses)


def exact(a, b):
    """dp / ZeRO: the same bits."""
    return np.array_equal(a, b)


def close(a, b):
    """tp: the ranks' partial sums (row-parallel outputs, column-parallel input gradients) are
    float64 sums in another order, and a gradient that is 0 in exact arithmetic (the key bias)
    keeps that noise through Adam: equal to a few fp32 ulps, not bits."""
    return np.allclose(a, b, rtol=1e-6, atol=1e-9)


def main():
    if ARGS.each is None:
        return run(ARGS, None)
    each_case(ARGS.each, lambda case: run(p.parse_args(case.split()), case), what="layout")


main()
