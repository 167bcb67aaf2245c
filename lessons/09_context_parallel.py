"""Lesson 09 -- long context: context parallelism, ring attention and Ulysses.

    mpirun -n 4 python lessons/09_context_parallel.py        # cp = 4
    mpirun -n 2 python lessons/09_context_parallel.py        # cp = 2
    python lessons/09_context_parallel.py                    # cp = 1: the same code, nothing split

Context parallelism (CP) cuts every sequence over the cp ranks: rank r holds T/cp tokens of
each row, so every per-token activation shrinks by cp. Only attention needs the other
ranks' tokens (docs/context_parallel.md):

    mesh = DeviceMesh(cp=4)
    model = parallelize(GPT(cfg, seed), mesh, context_parallel="ring")   # "ring-zigzag", "ulysses"

* Ring attention (Liu et al. 2023): each rank keeps its Q chunk; the K/V chunks go round
  the ring, and the partial results merge by the online softmax (running max m and sum l,
  FlashAttention; Milakov & Gimelshein 2018). Per attention layer each rank sends (cp-1)
  K/V chunks of 2 B (T/cp) n_kv hs e bytes forward, and backward (cp-1) K/V chunks again
  plus (cp-1) dK/dV chunks.
* Zigzag (Megatron's and Llama 3's head-tail split): 2cp chunks, rank r holds chunks r and
  2cp-1-r, so every rank computes 2cp+1 half-chunk pairs of the causal scores; contiguous
  chunks leave rank r with r+1 pairs, the last rank cp times the first.
* Ulysses (Jacobs et al. 2023): an all-to-all turns sequence sharding into head sharding
  around attention; four all-to-alls forward (q, k, v, output) and four backward, each
  (cp-1)/cp of its (B, T/cp, width) array. Heads must divide by cp.

The lesson prints, measured beside the formula:
  memory    one GPT block's activation bytes per rank vs T (``--mem-seq``): one process
            (pdist.measure.activation_memory: e(24 sbh + a s'^2 b + 2 sb), the scores grow as
            T^2) and under ring CP (e(26 sbh + a sb + 2 sb) at s = T/cp: K/V and the
            log-sum-exp instead of the scores, every term proportional to T/cp)
  bytes     what each rank sends per attention layer, forward and backward, ring and Ulysses
            (ProcessGroup.stats), and the op's time (median of ``--repeats`` calls, forward +
            backward, at B = --batch-size, T = the largest --mem-seq)
  work      the score elements each rank's ring attention computed (the op counts them),
            contiguous and zigzag, beside ``attention_work``; FLOPs = 4 B n_head hs times that
PASS means: --steps AdamW steps of GPT-2 and Llama (grouped-query) under ring, ring-zigzag and
Ulysses equal one process on the same global batches (float64, rtol 1e-9: the losses and every
parameter shard of every rank), each rank trained on B rows of T/cp tokens, the bytes on the cp
group per step = n_layer x the ring / Ulysses formula, and the measured memory, bytes and work
above equal their formulas.
"""
import os
import platform
import time

import numpy as np

from pdist import comm, data
from pdist.comm.mpi import local_size, node_cores
from pdist.course import lesson
from pdist.engine.autograd import Tensor
from pdist.engine.backend import is_gpu, synchronize, to_numpy, xp
from pdist.measure.activation_memory import formula_bytes, measure_block
from pdist.models import registry
from pdist.models.gpt import GPT
from pdist.parallel import parallelize
from pdist.parallel.context import install, zigzag
from pdist.parallel.context import ring_attention as ring
from pdist.parallel.context.ulysses import ulysses_attention, ulysses_bytes
from pdist.parallel.layout import box_slices
from pdist.training import train

MODES = ("ring", "ring-zigzag", "ulysses")


def parse():
    p = lesson.parser(__doc__, steps=3, dtype="float64", batch_size=4, n_layer=2, n_head=8, n_embd=32,
                      block_size=16, no_inject="lesson 09 checks equality to 1e-9; inject faults in lessons 02-07")
    p.add_argument("--mem-seq", default="32,64,128,256", help="sequence lengths of the memory table (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each attention op (default %(default)s)")
    args = lesson.validate(p, p.parse_args())
    if args.dtype != "float64":
        p.error("--dtype float64 only: the check is equality to one process at rtol 1e-9")
    try:
        args.mem_seq = sorted({int(s) for s in args.mem_seq.split(",")})
    except ValueError:
        p.error(f"--mem-seq {args.mem_seq!r}: give comma-separated sequence lengths, e.g. 64,128,256")
    if args.repeats < 1 or min(args.mem_seq) < 1:
        p.error("--repeats and every --mem-seq length must be >= 1")
    return p, args


def check_sizes(parser, args, cp):
    """Every size the runs need, on every rank, before any collective: zigzag cuts T in 2cp
    chunks, Ulysses splits the heads (GPT's n_head, Llama's n_head and n_kv_head = n_head/2)."""
    for name, T in [("--block-size", args.block_size)] + [("--mem-seq", t) for t in args.mem_seq]:
        if T % (2 * cp):
            parser.error(f"{name} {T}: zigzag context parallelism over cp = {cp} cuts T into {2 * cp} chunks; "
                         f"choose a multiple of {2 * cp}")
    if args.n_head % (2 * cp):
        parser.error(f"--n-head {args.n_head}: Ulysses over cp = {cp} splits the heads, and Llama has n_head / 2 "
                     f"kv heads: choose --n-head a multiple of {2 * cp}")
    if (args.n_embd // args.n_head) % 2:
        parser.error(f"--n-embd / --n-head = {args.n_embd // args.n_head}: Llama's RoPE needs an even head size")


def ring_block_formula(s, b, h, a, e):
    """A GPT block's activation bytes under ring attention (s tokens per rank): 24 sbh + 2 sb
    as one process, P replaced by the K/V kept for backward (2 sbh) and the lse (a sb)."""
    return e * (24 * s * b * h + 2 * s * b + 2 * s * b * h + a * s * b)


def memory_rows(world, args, vocab):
    """[(T, 1-process measured, formula, cp measured, formula)] for one GPT block; rank 0's."""
    cp, rows = world.size, []
    cfg = lesson.gpt_config(vocab, dtype="float64", block_size=max(args.mem_seq), n_layer=1, n_head=args.n_head,
                            n_embd=args.n_embd)
    model, b, h, a, e = GPT(cfg, args.seed), args.batch_size, cfg.n_embd, cfg.n_head, 8
    block, rng = model.transformer.h[0], np.random.default_rng(args.seed)
    one = []
    for T in args.mem_seq:                      # one process: the whole sequence (rank 0 alone)
        if world.rank == 0:
            x = Tensor(xp.asarray(rng.standard_normal((b, T, h))), requires_grad=True)
            one.append((measure_block(block, x)[0], formula_bytes(cfg, b, "none", e, seq=T)))
    ctx = install(model, world, "ring-zigzag")  # the same block, its attention now ring attention
    for i, T in enumerate(args.mem_seq):
        ctx.positions, s = zigzag.positions(T, cp, world.rank, "zigzag"), T // cp
        x = Tensor(xp.asarray(rng.standard_normal((b, s, h))), requires_grad=True)
        got = measure_block(block, x)[0]
        if world.rank == 0:
            rows.append((T, *one[i], got, ring_block_formula(s, b, h, a, e)))
    return rows


def attention_op(world, mode, args):
    """One GPT attention layer (fused qkv, B x T/cp tokens) forward + backward, ``repeats``
    times: (bytes sent [forward, backward], formula, score elements, median seconds)."""
    cp, T, B, H = world.size, max(args.mem_seq), args.batch_size, args.n_head
    hs = args.n_embd // H
    layout = "zigzag" if mode == "ring-zigzag" else "contiguous"
    rng = np.random.default_rng(args.seed + 1)
    qkv = xp.asarray(rng.standard_normal((B, T // cp, 3 * H * hs)))
    grad = xp.asarray(rng.standard_normal((B, T // cp, H * hs)))
    sent, secs = None, []
    for _ in range(args.repeats):
        x = Tensor(qkv.copy(), requires_grad=True)
        world.barrier()
        world.reset_stats()
        ring.work["scores"] = 0
        t0 = time.perf_counter()
        y = ulysses_attention(x, n_head=H, group=world) if mode == "ulysses" else \
            ring.ring_attention(x, n_head=H, group=world, layout=layout)
        fwd = world.bytes_sent()
        y.backward(grad)
        synchronize()
        secs.append(time.perf_counter() - t0)
        sent = sent or [fwd, world.bytes_sent() - fwd]
    want = ulysses_bytes(B, T, cp, H, H, hs, 8) if mode == "ulysses" else ring.ring_bytes(B, T, cp, H, hs, 8)
    work = None if mode == "ulysses" else ring.work["scores"]
    return sent, list(want), work, float(np.median(secs))


def train_run(world, cls_name, mode, args, tok, tokens, refs):
    """--steps AdamW steps under context_parallel=mode (cp = the world) vs one process."""
    kv = {"n_kv_head": args.n_head // 2} if cls_name == "llama" else {}
    cfg = lesson.gpt_config(tok.vocab_size, dtype="float64", model=cls_name, block_size=args.block_size,
                            n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, **kv)
    if cls_name not in refs:          # rank 0 trains the one process, every rank gets its result
        ref = lesson.train_reference(cfg, args.seed, args.steps, args.batch_size, tokens) \
            if world.rank == 0 else None
        refs[cls_name] = world.broadcast_object(ref, src=0)
    ref_losses, ref_sd = refs[cls_name]
    mesh = comm.DeviceMesh(cp=world.size)
    model = parallelize(registry.build(cfg, args.seed), mesh, context_parallel=mode)
    opt, sent, times, shapes = lesson.make_adamw(model.parameters()), [], [], []
    mesh.cp_group.reset_stats()

    def on_step(step, loss):
        sent.append(mesh.cp_group.bytes_sent())
        mesh.cp_group.reset_stats()
        shapes.append(model.local_shape)
        times.append(time.perf_counter())
    t0 = time.perf_counter()
    losses = train(model, opt, data.batch_fn(tokens, args.batch_size, args.block_size, args.seed),
                   args.steps, on_step=on_step)
    hs, n_kv = args.n_embd // args.n_head, kv.get("n_kv_head", args.n_head)
    per_layer = ulysses_bytes(args.batch_size, args.block_size, world.size, args.n_head, n_kv, hs, 8) \
        if mode == "ulysses" else ring.ring_bytes(args.batch_size, args.block_size, world.size, n_kv, hs, 8)
    want = cfg.n_layer * sum(per_layer)
    pieces = [(to_numpy(pc.view(pc.tensor.data)), to_numpy(ref_sd[pc.name])[box_slices(pc)]) for pc in model.pieces()]
    ok = (np.allclose(losses, ref_losses, rtol=1e-9, atol=0) and all(np.allclose(a, r, rtol=1e-9, atol=1e-12)
                                                                    for a, r in pieces)
          and all(s == (args.batch_size, args.block_size // world.size) for s in shapes)
          and all(s == want for s in sent))
    every = world.all_gather_object((bool(ok), sent[-1], max(float(np.max(np.abs(a - r))) for a, r in pieces)))
    return {"name": f"{cls_name} {mode}", "model": cls_name, "context_parallel": mode,
            "layout": {"dp": 1, "cp": world.size, "tp": 1, "pp": 1, "zero_stage": 0}, "dtype": "float64",
            "params": cfg.num_params(), "loss": losses, "baseline_loss": list(ref_losses),
            "comm_bytes_per_step": [e[1] for e in every], "comm_bytes_formula": want,
            "tokens_per_rank": list(shapes[-1]), "max_abs_diff": max(e[2] for e in every),
            "seconds_per_step": float(np.median(np.diff([t0] + times))), "check": "PASS" if all(
                e[0] for e in every) else "FAIL"}


def conditions():
    """The timing's conditions: ranks and cores on this node, load average, CPU, date."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else platform.processor() or "?"
    return (f"{local_size()} ranks on {node_cores()} cores, load average {os.getloadavg()[0]:.1f}, {cpu}, "
            f"{time.strftime('%Y-%m-%d')}")


def each(values):
    """Per-rank bytes: "X each" when the ranks agree, else every rank's."""
    if len(set(values)) == 1:
        return lesson.fmt_bytes(values[0]) + (" each" if len(values) > 1 else "")
    return "/".join(lesson.fmt_bytes(v) for v in values)


def show(mem, ops, trains, world, args):
    fb, cp, T = lesson.fmt_bytes, world.size, max(args.mem_seq)
    print(f"cp = {cp} (the whole world), GPT/Llama {args.n_layer} layers, C={args.n_embd}, {args.n_head} heads, "
          f"global batch {args.batch_size}, float64\n\nactivation memory of one GPT block per rank (B = "
          f"{args.batch_size}), measured beside the formula:")
    print(lesson.table([(t, fb(m1), fb(f1), fb(mc), fb(fc), f"{m1 / mc:.1f}x") for t, m1, f1, mc, fc in mem],
                       ["T", "1 process", "formula", f"ring cp={cp}", "formula T/cp", "saved"]))
    if is_gpu():
        print("  (on a device other ops keep more than the host's formula counts: the check is the host's)")
    print(f"\nbytes each rank sends per attention layer (B={args.batch_size}, T={T}), and the op's time "
          f"(forward + backward, median of {args.repeats}, the slowest rank; {conditions()}):")
    rows = [(m, each([b[0] for b, *_ in ops[m]]), fb(ops[m][0][1][0]), each([b[1] for b, *_ in ops[m]]),
             fb(ops[m][0][1][1]), f"{max(o[3] for o in ops[m]) * 1e3:.1f}") for m in MODES]
    print(lesson.table(rows, ["op", "forward per rank", "formula", "backward per rank", "formula", "ms"]))
    print("  ring: (cp-1) K/V chunks forward, (cp-1) K/V + (cp-1) dK/dV backward; Ulysses: 4 all-to-alls of "
          "(cp-1)/cp each way")
    hs = args.n_embd // args.n_head
    print(f"\nattention work per rank (score elements per sequence and head; FLOPs = 4 B n_head hs x this = "
          f"{4 * args.batch_size * args.n_head * hs} x):")
    for m, lay in (("ring", "contiguous"), ("ring-zigzag", "zigzag")):
        w = [o[2] for o in ops[m]]
        print(f"  {lay:>10}: measured {w}, formula {zigzag.attention_work(T, cp, lay)}, max/min "
              f"{max(w) / min(w):.2f}")
    print("\n" + lesson.table([(r["name"], f"{r['loss'][-1]:.9f}", f"{r['baseline_loss'][-1]:.9f}",
                                f"{r['max_abs_diff']:.1e}", "x".join(map(str, r["tokens_per_rank"])),
                                fb(r["comm_bytes_per_step"][0]), fb(r["comm_bytes_formula"]),
                                f"{r['seconds_per_step'] * 1e3:.1f}", r["check"]) for r in trains],
                              ["run", "loss", "1-proc loss", "max|dW|", "B x T/cp", "cp bytes/step", "formula",
                               "ms/step", "check"]))


def sections(mem, ops, world, args):
    """The measured sections as JSON records, and whether each equals its formula."""
    T, cp = max(args.mem_seq), world.size
    memory = {"name": "activation memory per rank vs T", "batch": args.batch_size,
              "rows": [{"T": t, "one_process": {"measured": m1, "formula": f1}, "cp": {"measured": mc, "formula": fc}}
                       for t, m1, f1, mc, fc in mem]}
    memory["check"] = all(r[1] == r[2] and r[3] == r[4] for r in mem) or is_gpu()  # (the host's formula:
    memory["device"] = "gpu" if is_gpu() else "host"         # on a device other ops keep more)
    attn = {"name": "attention bytes and time per layer", "batch": args.batch_size, "T": T,
            "ops": {m: {"bytes_per_rank": [o[0] for o in ops[m]], "formula": ops[m][0][1],
                        "seconds": max(o[3] for o in ops[m])} for m in MODES}}
    attn["check"] = all(o[0] == o[1] for m in MODES for o in ops[m])
    work = {"name": "attention work per rank", "T": T, "unit": "score elements per sequence and head",
            "flops_per_element": 4 * args.batch_size * args.n_embd,
            "contiguous": {"measured": [o[2] for o in ops["ring"]], "formula": zigzag.attention_work(T, cp)},
            "zigzag": {"measured": [o[2] for o in ops["ring-zigzag"]],
                       "formula": zigzag.attention_work(T, cp, "zigzag")}}
    work["check"] = all(work[k]["measured"] == work[k]["formula"] for k in ("contiguous", "zigzag"))
    out = [memory, attn, work]
    for s in out:
        s["check"] = "PASS" if s["check"] else "FAIL"
    return out


def main():
    parser, args = parse()
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    check_sizes(parser, args, world.size)
    if world.size == 1 and world.rank == 0:
        print("one process: cp = 1, nothing is split and no byte is sent (run it with mpirun -n 4 to cut "
              "each sequence over 4 ranks)\n", flush=True)
    mem = world.broadcast_object(memory_rows(world, args, tok.vocab_size), src=0)
    ops = {m: world.all_gather_object(attention_op(world, m, args)) for m in MODES}
    refs = {}                       # one process's (losses, state_dict) per model, trained once
    trains = [train_run(world, name, mode, args, tok, tokens, refs) for name in ("gpt2", "llama") for mode in MODES]
    runs = sections(mem, ops, world, args) + trains
    if world.rank == 0:
        show(mem, ops, trains, world, args)
    failed = [r["name"] for r in runs if r["check"] != "PASS"]
    lesson.finish("09_context_parallel", not failed, runs, args, rank=world.rank, world_size=world.size,
                  detail=(f"ring, ring-zigzag and Ulysses at cp = {world.size} equal one process (GPT-2 and Llama, "
                          "float64, rtol 1e-9); memory, bytes and work equal their formulas") if not failed
                  else "-- not equal: " + ", ".join(failed))


if __name__ == "__main__":
    main()
