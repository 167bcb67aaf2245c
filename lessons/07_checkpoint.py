"""Lesson 07 -- checkpoints that load under any layout (pdist/checkpoint/sharded.py, docs/checkpoint.md).

    mpirun -n 4 python lessons/07_checkpoint.py
    mpirun -n 4 python lessons/07_checkpoint.py --steps 10 --save-at 5 --dir ckpt
    mpirun -n 4 python lessons/07_checkpoint.py --precision bf16     # mixed precision (or fp16)

A sharded checkpoint is easy to write: every rank dumps what it holds. It is just as
easy to make one that only the same layout can read. Under ZeRO-3 on 4 ranks, rank r
holds the r-th quarter of each flat, padded unit; a dump of those shards means nothing
to 2 ranks, whose shards are halves, or to tensor parallelism, which cuts by rows and
columns. pdist saves *pieces of the single-process tensors* instead: every rank writes
the boxes it holds of each parameter and of Adam's m and v, with their offsets, and an
index says which file holds which box. A loading rank reads just the boxes that overlap
the pieces its own layout gives it (safetensors slices, memory-mapped).

The lesson trains ZeRO-3 on 4 ranks for --save-at steps and saves. It shows the naive
per-rank dump failing to load into 2 ranks, then loads the real checkpoint into dp 2 x
tp 2, into ZeRO-1 at dp 2 (each pair of ranks on its own), and into one process (every
rank alone), and continues training each to --steps. PASS when every continuation ends
equal to the uninterrupted single-process run (float64, rtol 1e-9 over all tensors; the
reduction order differs between layouts), and each rank's checkpoint file holds exactly
its share, 3·b·Ψ_r bytes of parameters, m and v (ZeRO-3: Ψ_r = the rank's unpadded
pieces, about Ψ/N).

``--precision bf16`` (or fp16): bf16 weights and gradients under fp32 masters
(docs/mixed_precision.md). The checkpoint holds the masters W, Adam's m and v (all
fp32: b = 4, so 3·4·Ψ_r bytes per rank) and, for fp16, the GradScaler's scale and growth
tracker (in index.json); a load restores them and re-derives w = round(W). The
reference is then one process in the same precision that rounds where the layouts do:
dp·m = 4 micro-batches (ZeRO-3 at dp 4) up to --save-at, then the loading layout's dp·m
(2 for dp 2 x tp 2 and ZeRO-1 at dp 2, 1 for one process). PASS: bit for bit at tp = 1;
rtol 1e-6 at tp 2 (its partial sums round at other points: lesson 06, docs/checkpoint.md).
"""
import os
import shutil
import tempfile
import time

import numpy as np

from pdist import checkpoint, comm, data
from pdist.course import lesson
from pdist.models.gpt import GPT
from pdist.parallel import Local, ZeRO, parallelize
from pdist.parallel.mixed_precision import MixedPrecision
from pdist.engine.precision import cast_module
from pdist.training import train


def parse():
    p = lesson.parser(__doc__, steps=8, dtype="float64", batch_size=8, precision=True)
    p.add_argument("--save-at", type=int, default=4, help="step after which to save (default %(default)s)")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = lesson.validate(p, p.parse_args())
    problem = lesson.dir_problem(args.dir) if args.dir else None
    if problem:
        p.error(f"--dir {args.dir}: {problem}")
    if not 1 <= args.save_at < args.steps:
        p.error(f"--save-at must be in [1, --steps), got {args.save_at} with --steps {args.steps}")
    return p, args


def payload_bytes(path):
    """Bytes of tensor data in a safetensors file: its size less the 8-byte length and the
    JSON header that length gives."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - header


def naive_dump_then_load(model, world, where):
    """What a layout-bound checkpoint does: each rank dumps its flat ZeRO shards; 2 ranks
    then try to read them. Returns the error every rank of the 2 saw (or None)."""
    from safetensors.numpy import load_file, save_file
    save_file({u.name: np.ascontiguousarray(u.shard.data) for u in model.units},
              os.path.join(where, f"rank-{world.rank}.safetensors"))
    world.barrier()
    pair = world.split(0 if world.rank < 2 else 1, name="pair")
    if world.rank >= 2:
        return None
    z = ZeRO(GPT(model.module.config, 0), 3, pair)
    try:
        saved = load_file(os.path.join(where, f"rank-{pair.rank}.safetensors"))
        for u in z.units:
            if saved[u.name].shape != u.shard.data.shape:
                raise ValueError(f"{u.name}: the file holds {saved[u.name].shape[0]} elements (1/4 of the padded "
                                 f"flat unit, written by 4 ranks) but this rank's shard has "
                                 f"{u.shard.data.shape[0]} (1/2): the dump is tied to the layout that wrote it, "
                                 f"and ranks 2 and 3's files would never be read")
            u.shard.data[...] = saved[u.name]
    except ValueError as e:
        return str(e)
    return None


def mixed(strategy, gpt, precision, *a):
    """``strategy(gpt, *a)`` in ``precision``: fp32 as is, else bf16/fp16 weights under fp32 masters."""
    if precision == "fp32":
        return strategy(gpt, *a)
    return MixedPrecision(strategy(cast_module(gpt, precision), *a), precision)


def reference(cfg, args, batch, k_after):
    """One process in --precision through the same rounding points as the layouts: dp·m = 4
    micro-batches up to --save-at (ZeRO-3 on 4 ranks), then ``k_after`` (the loading layout's
    dp·m). fp32: one micro-batch throughout. Returns (losses, full state dict)."""
    low = args.precision != "fp32"
    model = mixed(Local, GPT(cfg, args.seed), args.precision, 4 if low else 1)
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, args.save_at)
    if low:
        model.find(Local).microbatches = k_after
    losses += train(model, opt, batch, args.steps - args.save_at, start=args.save_at)
    return losses, model.full_state_dict()


def tolerance(args, name):
    """fp32 (float64): rtol 1e-9, the reduction order differs. bf16/fp16: bit for bit where the
    loading layout rounds as its reference does (tp = 1), else rtol 1e-6: tensor parallelism's
    partial sums round at other points (one unit roundoff of fp32 compute, far below bf16's)."""
    if args.precision == "fp32":
        return dict(rtol=1e-9, atol=1e-12)
    return dict(rtol=1e-6, atol=1e-9) if "tp 2" in name else dict(rtol=0, atol=0)


def continue_from(name, model, ckpt, args, batch, ref):
    """Load the checkpoint into ``model``, train to --steps, compare with the reference."""
    opt = lesson.make_adamw(model.parameters())
    t0 = time.perf_counter()
    step, extra = checkpoint.load(model, opt, ckpt)
    secs = time.perf_counter() - t0
    assert step == args.save_at and extra["next_step"] == args.save_at, (step, extra)
    losses = train(model, opt, batch, args.steps - step, start=extra["next_step"])
    full, (ref_losses, ref_sd) = model.full_state_dict(), ref
    num = sum(float(np.sum((full[k] - ref_sd[k]) ** 2)) for k in ref_sd)
    den = sum(float(np.sum(ref_sd[k] ** 2)) for k in ref_sd)
    ok = all(np.allclose(full[k], ref_sd[k], **tolerance(args, name)) for k in ref_sd)
    return {"name": name, "load_seconds": secs, "loss": losses[-1], "rel_err": float(np.sqrt(num / den)),
            "ok": ok, "baseline_loss": ref_losses[-1]}


def main():
    parser, args = parse()
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    if world.size != 4:
        parser.error(f"this lesson saves on 4 ranks and loads into 4, 2 and 1: run it with mpirun -n 4 "
                     f"(got {world.size})")
    if args.batch_size % 4:
        parser.error(f"--batch-size {args.batch_size} must divide by 4 ranks")
    cfg = lesson.config_from_args(args, tok.vocab_size)

    def batch(step):
        return data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)

    refs = {k: reference(cfg, args, batch, k) for k in (2, 1)}     # by the loading layout's dp·m
    ref_losses = refs[1][0]
    root = args.dir or (tempfile.mkdtemp(prefix="pdist-lesson07-") if world.rank == 0 else None)
    root = world.broadcast_object(root)
    ckpt = os.path.join(root, f"step-{args.save_at:06d}")

    # 1. ZeRO-3 on 4 ranks, then save
    z3 = mixed(ZeRO, GPT(cfg, args.seed), args.precision, 3, world)
    opt = lesson.make_adamw(z3.parameters())
    train(z3, opt, batch, args.save_at)
    t0 = time.perf_counter()
    checkpoint.save(z3, opt, ckpt, step=args.save_at, extra={"seed": args.seed, "next_step": args.save_at,
                                                               "batch_size": args.batch_size},
                    overwrite=True)                 # a rerun with the same --dir replaces its own checkpoint
    save_s = time.perf_counter() - t0
    mine = payload_bytes(os.path.join(ckpt, f"rank-{world.rank:05d}.safetensors"))
    b = np.dtype(args.dtype if args.precision == "fp32" else np.float32).itemsize   # mixed: fp32 masters
    share = 3 * b * sum(int(np.prod(p.shape)) for p in z3.pieces())    # params + m + v, no padding
    sizes = world.all_gather_object((mine, share))

    # 2. the naive dump, loaded into 2 ranks
    naive_dir = world.broadcast_object(tempfile.mkdtemp(prefix="pdist-naive-") if world.rank == 0 else None)
    naive_error = naive_dump_then_load(z3.find(ZeRO), world, naive_dir)

    # 3. the real checkpoint, into three other layouts
    prec = args.precision
    dp2tp2 = parallelize(GPT(cfg, 99), comm.DeviceMesh(dp=2, tp=2), precision=prec)
    runs = [continue_from("dp 2 x tp 2", dp2tp2, ckpt, args, batch, refs[2])]
    pair = world.split(0 if world.rank < 2 else 1, name="pair")
    runs.append(continue_from("ZeRO-1, dp 2", mixed(ZeRO, GPT(cfg, 99), prec, 1, pair), ckpt, args, batch,
                              refs[2]))
    runs.append(continue_from("1 process", mixed(Local, GPT(cfg, 99), prec), ckpt, args, batch, refs[1]))
    every = world.all_gather_object(runs)
    ok = all(r["ok"] for rs in every for r in rs) and all(m == s for m, s in sizes)
    if world.rank == 0:
        report(args, cfg, save_s, sizes, naive_error, every, ref_losses)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(naive_dir, ignore_errors=True)
    summary = [{"name": r["name"], "dtype": args.dtype, "params": cfg.num_params(),
                "load_seconds": max(rs[i]["load_seconds"] for rs in every), "loss": r["loss"],
                "baseline_loss": r["baseline_loss"], "precision": args.precision,
                "rel_err": max(rs[i]["rel_err"] for rs in every)}
               for i, r in enumerate(every[0])]
    equal = "each continuation equals the uninterrupted run" if prec == "fp32" else \
        f"{prec}: each continuation equals its one-process reference"
    lesson.finish("07_checkpoint", ok, summary, args, rank=world.rank, world_size=world.size,
                  detail="(saved under ZeRO-3 on 4 ranks; loaded into dp 2 x tp 2, ZeRO-1 at dp 2 and "
                         f"one process, {equal})" if ok else "(see the table)")


def report(args, cfg, save_s, sizes, naive_error, every, ref_losses):
    fb = lesson.fmt_bytes
    prec = "" if args.precision == "fp32" else f", {args.precision} weights, fp32 masters"
    print(f"GPT Ψ = {cfg.num_params():,} ({args.dtype}{prec}); trained {args.save_at} steps under ZeRO-3 on 4 ranks, saved "
          f"in {save_s * 1e3:.0f} ms; uninterrupted run: {args.steps} steps, final loss {ref_losses[-1]:.6f}\n")
    print(lesson.table([(r, fb(m), fb(s), "yes" if m == s else "NO") for r, (m, s) in enumerate(sizes)],
                       ["rank", "file", "3·b·Ψ_r (params, m, v)", "="]))
    print("\nthe naive dump (each rank's flat ZeRO-3 shards), loaded into 2 ranks:\n  "
          + (f"ValueError: {naive_error}" if naive_error else "loaded?! (it should not have)") + "\n")
    rows = []
    for i, r in enumerate(every[0]):
        rows.append((r["name"], f"{max(rs[i]['load_seconds'] for rs in every) * 1e3:.0f}",
                     f"{r['loss']:.6f}", f"{r['baseline_loss']:.6f}", f"{max(rs[i]['rel_err'] for rs in every):.1e}",
                     "yes" if all(rs[i]["ok"] for rs in every) else "NO"))
    ref = "uninterrupted" if args.precision == "fp32" else "reference (dp·m)"
    print(lesson.table(rows, ["loaded into", "load ms", "final loss", ref, "|θ-θ_ref|/|θ_ref|",
                              "equal"]))
    print()


if __name__ == "__main__":
    main()
