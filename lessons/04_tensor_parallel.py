"""Lesson 04 -- tensor parallelism (Megatron-LM) and sequence parallelism.

    python lessons/04_tensor_parallel.py                  # t = 1: no communication at all
    mpirun -n 2 python lessons/04_tensor_parallel.py      # t = 2 (or -n 4)
    mpirun -n 4 python lessons/04_tensor_parallel.py --steps 10 --dtype float64 --json tp.json
    mpirun -n 2 python lessons/04_tensor_parallel.py --n-layer 4 --n-head 8 --n-embd 128
    mpirun -n 2 python lessons/04_tensor_parallel.py --precision bf16   # mixed precision (or fp16)

The model is the one pdist.models.gpt.GPT; TensorParallel(GPT(cfg, seed), tp_group) transforms it
in place (each rank keeps its shards; model.pieces() says where each sits in the full
tensor). t (the number of ranks) must divide n_head, n_embd and the vocabulary, and T
(--block-size) for sequence parallelism: otherwise every rank stops with the reason.

Every rank holds a 1/t slice of every big weight (Shoeybi et al. 2019): attention is
split by heads (the fused c_attn by columns, c_proj by rows), the MLP column then row,
the embedding and the tied LM head by vocabulary, and the loss is computed from
vocabulary-sharded logits (two small all-reduces: max, then the sums). Each
transformer layer costs 2 all-reduces forward (after attn.c_proj and mlp.c_proj, "g")
and 2 backward (before c_attn and c_fc, "f"). Sequence parallelism (Korthikanti et
al. 2022) turns each all-reduce into an all-gather + reduce-scatter pair -- the same
bytes -- so LayerNorm, dropout and the residual stream hold T/t tokens per rank.
Code: pdist/parallel/tensor/tensor_parallel.py (the transform, as the model's plan says:
pdist/models/gpt_plan.py), layers.py (the layers), regions.py (f and g).

The lesson trains both layouts for --steps AdamW steps through the one training loop
(pdist.training.train) beside single-process training on the same global batches
(pdist.course.lesson.train_reference) and prints: the loss per step; the collectives of one
transformer layer, measured with hooks around block 0, and of the whole step, next to
Megatron's count; the bytes each rank sends per step (the strategy's collectives only:
the loop's loss reduction runs on a private copy of the group); the parameter bytes per
rank. PASS means: every step's loss equals the single-process loss (rtol 1e-6 in
float64, 1e-3 in float32), every rank's pieces after the first min(--steps, 10) steps
equal the same boxes of the single-process weights (float64: elementwise rtol 1e-9;
float32: per tensor, relative norm 1e-3; see lessons/02_data_parallel.py for why
training amplifies rounding after that), and the measured collectives equal Megatron's
counts.

``--precision bf16`` (or fp16): both layouts train with bf16 parameters and gradients and
fp32 master weights (MixedPrecision, docs/mixed_precision.md), against one process in the same
precision; sequence parallelism sums each rank's unrounded LayerNorm / bias / wpe gradients
before it rounds them once (pdist/engine/grad_rounding.py), as one process does. PASS then
means: losses and pieces to rtol 1e-6 (float64: the ranks' partial sums in another order,
far below a bf16 ulp of 2^-8), or the float32 checks below.

float32 and the key bias: the gradient of the K third of c_attn.bias is exactly zero in
exact arithmetic (softmax_j(q.(k_j + b)) = softmax_j(q.k_j + q.b): a constant per row),
so what each run computes there is rounding noise (~1e-9 in float32), and AdamW divides
it by its own root-mean-square: both runs take steps of about lr in random directions.
In float32 the parameter check therefore skips that third (in float64 the noise,
~1e-17, stays far below AdamW's eps = 1e-8 and everything is checked elementwise).
"""
import statistics
import time

import numpy as np

from pdist import data
from pdist.course import lesson
from pdist.measure import memory
from pdist.engine import precision
from pdist.engine.backend import synchronize, to_numpy
from pdist.models.gpt import GPT
from pdist.parallel import MixedPrecision, TensorParallel
from pdist.parallel.layout import box_slices
from pdist.parallel.tensor.tensor_parallel import check_tp_config
from pdist.training import train

FORMULA = {(False, "per_step"): "4L+4 AR", (True, "per_step"): "4L+2 AG, 4L+2 RS, 3 AR",
           (False, "per_layer_forward"): "2 AR", (False, "per_layer_backward"): "2 AR",
           (True, "per_layer_forward"): "2 AG, 2 RS", (True, "per_layer_backward"): "2 AG, 2 RS"}


def megatron(t, L, sp):
    """Megatron's collectives (t > 1): per layer forward, per layer backward, per step."""
    if t == 1:
        return {}, {}, {}
    if not sp:  # + embedding 1 (forward), head's f 1 (backward), loss 2 (max, sums)
        return {"all_reduce": 2}, {"all_reduce": 2}, {"all_reduce": 4 * L + 4}
    pair = {"all_gather": 2, "reduce_scatter": 2}  # + embedding and head 1 each way; loss 2 + SP grads 1
    return pair, pair, {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 2, "all_reduce": 3}


def shards_match(model, ref, dtype, mixed=False):
    """This rank's pieces (model.pieces()) against the same boxes of the single-process weights.
    float64: elementwise rtol 1e-9. float32: per tensor |got - want| / |want| <= 1e-3 (an element
    whose gradient is near rounding noise moves by ~lr either way), without the key-bias third
    of c_attn.bias, whose gradient is pure noise (see the docstring)."""
    got, want = {}, {}
    for p in model.pieces():
        a, b = to_numpy(p.view(p.tensor.data)), ref[p.name][box_slices(p)]
        C = p.global_shape[0] // 3
        if dtype == "float32" and p.name.endswith("attn.c_attn.bias") and C <= p.offsets[0] < 2 * C:
            continue  # [q | k | v]: this piece lies in the k third
        got.setdefault(p.name, []).append(a.ravel())
        want.setdefault(p.name, []).append(b.ravel())
    for name in got:
        a, b = np.concatenate(got[name]), np.concatenate(want[name])
        rtol, atol = (1e-6, 1e-9) if mixed else (1e-9, 1e-12)
        if dtype == "float64" and not np.allclose(a, b, rtol=rtol, atol=atol):
            return False
        if dtype == "float32" and np.linalg.norm(a - b) > 1e-3 * np.linalg.norm(b):
            return False
    return True


def count_block(world, block):
    """Hooks around one transformer block: {'fwd': its forward's collectives, 'bwd': its
    backward's}, counted from world.stats (calls per op), refreshed every step."""
    marks = {}

    def calls():
        return {op: s["calls"] for op, s in world.stats.items()}

    def diff(after, before):
        return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0)}

    def around_block(module, a, out):
        marks["fwd"] = diff(calls(), marks.pop("pre"))
        out.register_hook(lambda g: marks.__setitem__("bwd_start", calls()))
        a[0].register_hook(lambda g: marks.__setitem__("bwd", diff(calls(), marks["bwd_start"])))
    block.register_forward_pre_hook(lambda m, a: marks.__setitem__("pre", calls()))
    block.register_forward_hook(around_block)
    return marks, calls


def run(name, sp, world, cfg, tokens, args, base):
    """Train TensorParallel(GPT) for --steps steps through the one loop; its JSON record and
    whether every rank matched the single-process run."""
    base_losses, base_state = base
    t, check_steps = world.size, min(args.steps, 10)
    model = TensorParallel(GPT(cfg, seed=args.seed), world, sequence_parallel=sp)
    mixed = args.precision != "fp32"
    if mixed:                  # the shards in bf16/fp16 (after TP cut them), fp32 masters outside
        precision.cast_module(model.module, args.precision)
        model = MixedPrecision(model, args.precision)
    opt = lesson.make_adamw(model.parameters())
    marks, calls = count_block(world, model.module.transformer.h[0])
    times, ok = [], [True]

    def batch(step):           # each step starts here: counts and bytes are the step's own
        world.reset_stats()
        times.append(-time.perf_counter())
        return data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)

    def on_step(step, loss):
        synchronize()  # the step's device work is done (no-op on CPU)
        times[-1] += time.perf_counter()
        if step + 1 == check_steps:
            ok[0] = shards_match(model, base_state, args.dtype, mixed)

    losses = train(model, opt, batch, args.steps, on_step=on_step)
    per_layer_fwd, per_layer_bwd, per_step = megatron(t, cfg.n_layer, sp)
    counted = {"per_layer_forward": marks["fwd"], "per_layer_backward": marks["bwd"], "per_step": calls()}
    expected = {"per_layer_forward": per_layer_fwd, "per_layer_backward": per_layer_bwd, "per_step": per_step}
    loss_rtol = 1e-6 if args.dtype == "float64" else 1e-3       # (mixed: the same, see the docstring)
    passed = ok[0] and np.allclose(losses, base_losses, rtol=loss_rtol, atol=0) and counted == expected
    mem = memory.memory_row(world.rank, model, opt)   # the gradients stay allocated between steps
    rec = {"name": name, "layout": {"dp": 1, "tp": t, "pp": 1, "zero_stage": 0}, "dtype": args.dtype,
           "precision": args.precision,
           "params": cfg.num_params(), "sequence_parallel": sp,
           "loss": losses, "baseline_loss": list(base_losses),
           "memory_per_rank": world.all_gather_object(mem),
           "comm_bytes_per_step": world.all_gather_object(world.bytes_sent()),  # the last step's
           "collectives": counted, "megatron": expected,
           "seconds_per_step": statistics.median(times[1:] or times)}
    return rec, all(world.all_gather_object(bool(passed)))


def report(tp_run, sp_run, cfg, args, t):
    B, T, C, L = args.batch_size, cfg.block_size, cfg.n_embd, cfg.n_layer
    base_losses, psi = tp_run["baseline_loss"], tp_run["params"]
    print(f"GPT {L} layers, {cfg.n_head} heads, n_embd {C}, vocab {cfg.vocab_size}, "
          f"Psi = {psi:,} ({args.dtype}); "
          f"t = {t} tensor-parallel rank(s), batch {B} x {T} tokens on every rank\n")
    rows = [(s, base_losses[s], tp_run["loss"][s], sp_run["loss"][s],
             max(abs(tp_run["loss"][s] - base_losses[s]), abs(sp_run["loss"][s] - base_losses[s])))
            for s in range(args.steps)]
    print(lesson.table(rows, ["step", "1 process", "TP", "TP + SP", "max |diff|"], "{:.6g}"))

    def fmt(d):
        short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
        return ", ".join(f"{v} {short.get(k, k)}" for k, v in sorted(d.items())) or "none"
    rows = []
    for rec in (tp_run, sp_run):
        for key, label in (("per_layer_forward", "1 layer fwd"), ("per_layer_backward", "1 layer bwd"),
                           ("per_step", "whole step")):
            rows.append((rec["name"], label, fmt(rec["collectives"][key]), fmt(rec["megatron"][key]),
                         FORMULA[rec["sequence_parallel"], key] if t > 1 else "none (t = 1)"))
    print("\ncollectives (AR all-reduce, AG all-gather, RS reduce-scatter) measured from ProcessGroup.stats;"
          "\none layer = between hooks around block 0")
    print(lesson.table(rows, ["run", "where", "measured", "Megatron", f"formula (L = {L})"]))
    S = B * T * C * np.dtype(args.dtype).itemsize
    act = (4 * L + 2) * 2 * (t - 1) / t * S
    rows = [(rec["name"], lesson.fmt_bytes(rec["comm_bytes_per_step"][0]), lesson.fmt_bytes(act),
             lesson.fmt_bytes(rec["memory_per_rank"][0]["params_bytes"]),
             lesson.fmt_bytes(psi * np.dtype(args.dtype).itemsize), f"{rec['seconds_per_step'] * 1e3:.1f}")
            for rec in (tp_run, sp_run)]
    print(f"\nper step, rank 0: bytes sent (ring accounting) next to the activation all-reduces alone,"
          f"\n(4L+2) x 2(t-1)/t x S with S = B*T*C*bytes = {lesson.fmt_bytes(S)} (the rest: the loss's"
          f"\nall-reduces and, with SP, the one of the LayerNorm/bias/wpe grads); parameter bytes per rank")
    print(lesson.table(rows, ["run", "sent", "(4L+2)2(t-1)/t S", "params/rank", "params, 1 proc", "step ms"]))


def main():
    ap = lesson.parser(__doc__, steps=10, dtype="float64", batch_size=8, precision=True)
    args = lesson.validate(ap, ap.parse_args())
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    t, rank = world.size, world.rank
    cfg = lesson.config_from_args(args, tok.vocab_size)
    try:  # the same check, the same message on every rank, before any collective
        check_tp_config(cfg, t)
        if cfg.block_size % t:
            raise ValueError(f"sequence parallelism needs T = {cfg.block_size} (--block-size) divisible by "
                             f"{t} ranks")
    except ValueError as e:
        ap.error(f"[rank {rank}] {e}")
    check_steps = min(args.steps, 10)
    if rank == 0:  # the baseline once, on rank 0; every rank needs its slices of the weights
        ref = dict(tokens=tokens, precision=args.precision)
        base = (lesson.train_reference(cfg, args.seed, args.steps, args.batch_size, **ref)[0],
                lesson.train_reference(cfg, args.seed, check_steps, args.batch_size, **ref)[1])
    base = world.broadcast_object(base if rank == 0 else None)
    tp_run, ok_tp = run("tp", False, world, cfg, tokens, args, base)
    sp_run, ok_sp = run("tp_sp", True, world, cfg, tokens, args, base)
    if rank == 0:
        report(tp_run, sp_run, cfg, args, t)
    lesson.finish("04_tensor_parallel", ok_tp and ok_sp, [tp_run, sp_run], args, rank=rank, world_size=t,
                  detail=f"-- t = {t}: losses of {args.steps} steps and shards after {check_steps} steps "
                         f"equal single-process training; collectives equal Megatron's count")


if __name__ == "__main__":
    main()
