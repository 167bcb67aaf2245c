"""Lesson 06 -- 3-D parallelism: data x tensor x pipeline parallelism on one mesh.

    mpirun -n 8 python lessons/06_mesh.py                          # dp 2 x tp 2 x pp 2, ZeRO-1, SP
    mpirun -n 4 python lessons/06_mesh.py --dp 2 --tp 2 --pp 1     # any pair
    mpirun -n 4 python lessons/06_mesh.py --dp 1 --tp 2 --pp 2 --schedule gpipe
    python lessons/06_mesh.py                                      # 1 rank: the same loop, nothing split
    mpirun -n 4 python lessons/06_mesh.py --dp 2 --tp 2 --pp 1 --precision bf16   # mixed precision
    mpirun -n 4 python lessons/06_mesh.py --tp 2 --pp 2 --precision fp16
    mpirun -n 8 python lessons/06_mesh.py --dp-replicate 2 --dp-shard 2 --tp 2 --pp 1 --zero 3   # HSDP

``--dp-replicate R --dp-shard S`` (either one with --dp, or both; dp = R·S) is hybrid sharding
(HSDP, pdist/parallel/zero/hsdp.py, docs/zero.md): with --zero 1-3 ZeRO shards over the S ranks
of a shard group and the R shard groups are replicas; the table's "dp" columns are then the
shard group's (ZeRO's formulas with N = S) and "dp_rep" the replicas' all-reduce of each
shard, 2(R-1)/R·bΨ_pad/S. With --zero 0 it is DDP over all of dp. fp32 only (its bits
check assumes one reduction over dp).

``--precision bf16`` (or fp16; any layout) trains with bf16 params and grads and fp32 masters
(docs/mixed_precision.md); the memory formula is the paper's (2 + 2 + 12 bytes per parameter)
and the reference is one process in the same precision with dp x m micro-batches: equal bit
for bit at tp = 1 when dp = 1 or m = 1, to rtol 1e-6 with tp > 1 (partial sums in another
order), and with dp > 1 and m > 1 (each rank rounds its own mean first) to a 2-norm error of 1e-2.

Without --dp/--tp/--pp the layout follows the world size: 8 ranks 2 x 2 x 2, 4 ranks
dp 2 x tp 2, 2 ranks tp 2, 1 rank 1 x 1 x 1. With some given, the first one left out
(dp, then tp, then pp) takes what remains of the world and the others are 1.

The world is a grid of ranks, world = (pp * DP + dp) * TP + tp (Megatron's order:
the tensor-parallel ranks, which talk most, are neighbours). ``parallelize`` turns the
one GPT into this rank's part (pdist/parallel/parallelize.py):

    TensorParallel    the tp group splits every matrix (Shoeybi et al. 2019; with --sp the
                      sequence too, Korthikanti et al. 2022)
    PipelineParallel  the pp group splits the stack of blocks into stages, run by a schedule
                      over --microbatches micro-batches (Narayanan et al. 2021)
    DataParallel/ZeRO the dp group splits the batch and averages (or reduce-scatters) the
                      gradients (Rajbhandari et al. 2020, --zero 1 or 2; ZeRO-3 with pp = 1)

and trains it with the one loop (pdist.training.train) every lesson uses.

The lesson prints (rank 0, gathered from every rank):
  the mesh       each world rank's (dp, tp, pp) coordinate and its node (its hostname; on
                 several nodes, which axis stays inside a node: with mpiexec's block placement
                 tp, the fastest-varying coordinate, does) (the vocabulary is padded to a
                 multiple of tp, as GPT-2 pads 50257 to 50304)
  memory         per rank, bytes of params / grads / Adam m, v (pdist.measure.memory: each buffer
                 once) beside the formula for this layout: Ψ_r = the parameters of this
                 rank's stage and tensor shard (counted from the config, lm_head's copy
                 of wte included on the last stage), b bytes each; ZeRO's formula over
                 the dp group with Ψ_pad = Σ_units ceil(Ψ_u/N)·N (lesson 03); and what the
                 process holds: rss (after the last step) and rss peak (during it), the
                 interpreter and libraries included (lesson 03 compares them with the formula)
  bytes/step     what each rank sent per step in each group (ProcessGroup.stats, ring
                 accounting) beside the theory: dp 2(N-1)/N·bΨ_r (ZeRO-1/2: RS + AG of
                 Ψ_pad; ZeRO-3 with m micro-batches: 2m AG + 1 RS); pp m·v activations forward + m·v gradients backward minus the
                 ends; tp by Megatron's count (4 all-reduces per block and micro-batch,
                 or with SP all-gathers + reduce-scatters, and the embedding, head and loss)
PASS means: after min(--steps, 10) steps every piece every rank holds equals the same box
of the single-process model (float64 rtol 1e-9; float32 relative norm 1e-3: three
reductions reordered at once, and AdamW turns float32 rounding of near-zero gradients into
steps of about lr, lesson 03 says more), the losses of those steps too (1e-9 / 1e-4), memory = formula and bytes = theory on
every rank.
"""
import math
import time
from types import SimpleNamespace

import numpy as np

from pdist import comm, data
from pdist.comm import nodes
from pdist.comm.mesh import split_dp
from pdist.course import lesson
from pdist.measure import memory
from pdist.engine import precision
from pdist.engine.backend import synchronize
from pdist.models import registry
from pdist.models.plan import matches, tp_split
from pdist.parallel import Local, MixedPrecision, check_layout, parallelize
from pdist.parallel.layout import box_slices
from pdist.parallel.pipeline.stages import partition_layers
from pdist.parallel.pipeline.schedules import virtual_stage
from pdist.training import train

CHECK_STEPS = 10


def parse():
    p = lesson.parser(__doc__, steps=10, dtype="float64", batch_size=16, n_layer=4, precision=True, models=True)
    for axis in ("dp", "tp", "pp"):
        p.add_argument(f"--{axis}", type=int, default=None, help=f"{axis} size (default: from the world size)")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage inside dp (default: 1 when dp > 1)")
    p.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (default: on if tp > 1)")
    p.add_argument("--no-sp", dest="sp", action="store_false")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--chunks", type=int, default=None, help="model chunks per rank (interleaved: default 2)")
    p.add_argument("--dp-replicate", type=int, default=None, help="HSDP: replicas of each shard (dp = R·S)")
    p.add_argument("--dp-shard", type=int, default=None, help="HSDP: ranks of a shard group (dp = R·S)")
    args = lesson.validate(p, p.parse_args())
    if args.dp_replicate is not None or args.dp_shard is not None:     # dp from the split, or checked against it
        try:
            args.dp, args.dp_replicate, args.dp_shard = split_dp(args.dp, args.dp_replicate, args.dp_shard)
        except ValueError as e:
            p.error(str(e).replace("DeviceMesh", "--dp/--dp-replicate/--dp-shard"))
        if args.precision != "fp32":
            p.error(f"--dp-replicate/--dp-shard with --precision {args.precision}: the bits check assumes one "
                    f"reduction over dp; use --precision fp32")
    for axis in ("dp", "tp", "pp"):
        if getattr(args, axis) is not None and getattr(args, axis) < 1:
            p.error(f"--{axis} must be >= 1, got {getattr(args, axis)}")
    return p, args


def layout_for(args, world_size):
    """Fill in --dp/--tp/--pp not given (see the docstring) and the SP/chunk defaults."""
    if (args.dp, args.tp, args.pp) == (None, None, None):
        args.dp, args.tp, args.pp = {8: (2, 2, 2), 4: (2, 2, 1), 2: (1, 2, 1)}.get(world_size, (world_size, 1, 1))
    else:          # what is left out: dp takes what remains of the world (else the one missing axis)
        given = math.prod(v for v in (args.dp, args.tp, args.pp) if v is not None)
        missing = [a for a in ("dp", "tp", "pp") if getattr(args, a) is None]
        rest = world_size // given if world_size % given == 0 else 1
        for a in missing:
            setattr(args, a, rest if a == missing[0] else 1)
    if args.sp is None:
        args.sp = args.tp > 1
    if args.chunks is None:
        args.chunks = 2 if args.schedule == "interleaved" else 1
    if args.zero is None:
        args.zero = 1 if args.dp > 1 else 0
    if args.dp_shard is None:
        args.dp_replicate, args.dp_shard = 1, args.dp
    args.hybrid = args.dp_replicate > 1 and args.zero >= 1     # HSDP: ZeRO over dp_shard, replicas across


def local_numel(cfg, names, t):
    """Ψ_r: elements of ``names`` on one tp rank (the tensors the model's plan splits, / t)."""
    shapes, plan = cfg.param_shapes(), cfg.parallel_plan()
    return sum(math.prod(shapes[n]) // (t if tp_split(plan, n) else 1) for n in names)


def stage_names(cfg, args, pp_rank):
    """The single-process names of the parameters this pp rank holds (a tied head's copy
    under the name it copies), from the config and the model's plan alone."""
    pp, V = cfg.parallel_plan().pipeline, args.pp * args.chunks
    spans = partition_layers(cfg.n_layer, V)
    ks = [virtual_stage(c, args.pp, pp_rank) for c in range(args.chunks)]
    first, last = 0 in ks, V - 1 in ks
    blocks = [f"{pp.blocks}.{i}." for k in ks for i in range(*spans[k])]
    own = [m + "." for m in pp.first_modules * first + pp.last_modules * last]
    parts = [f"{pp.blocks}."] + [m + "." for m in pp.first_modules + pp.last_modules]
    names = [n for n in cfg.param_shapes() if n.startswith(tuple(blocks + own)) or not n.startswith(tuple(parts))]
    return names + [src for src in pp.tied.values() if last and not first]


def stage_units(cfg, args, pp_rank):
    """This rank's ZeRO units (the root first, then the plan's units) as lists of names."""
    units, root = {}, []
    for n in stage_names(cfg, args, pp_rank):
        segs = n.split(".")
        unit = next((".".join(segs[:len(u.split("."))]) for u in cfg.parallel_plan().zero_units
                     if len(segs) > len(u.split(".")) and matches(u, ".".join(segs[:len(u.split("."))]))), None)
        (units.setdefault(unit, []) if unit else root).append(n)
    return [root] + list(units.values())


def memory_formula(cfg, args, pp_rank, b, k=None):
    """(params, grads, optim) bytes: b per param and grad, k per optimizer state (Adam: 2b;
    mixed precision: b = 2, k = 12, the fp32 master, m and v)."""
    units = [local_numel(cfg, u, args.tp) for u in stage_units(cfg, args, pp_rank)]
    N, psi, k = args.dp_shard if args.hybrid else args.dp, sum(units), 2 * b if k is None else k
    pad = sum(-(-u // N) * N for u in units)
    return {0: (b * psi, b * psi, k * psi), 1: (b * pad, b * pad, k * pad // N),
            2: (b * pad, b * pad // N, k * pad // N),
            3: (b * pad // N, b * pad // N, k * pad // N)}[args.zero]


def comm_theory(cfg, args, coords, b, b_act=None):
    """Bytes this rank sends per step in each group (ring accounting): b bytes per parameter
    and gradient element, b_act per activation element (mixed precision: 2 and the compute dtype's)."""
    b_act = b if b_act is None else b_act
    pp_rank = coords.pp
    units = [local_numel(cfg, u, args.tp) for u in stage_units(cfg, args, pp_rank)]
    N, t, psi = args.dp_shard if args.hybrid else args.dp, args.tp, sum(units)    # HSDP: ZeRO over dp_shard
    pad = sum(-(-u // N) * N for u in units)
    R = args.dp_replicate if args.hybrid else 1
    dp_rep = 2 * (R - 1) * b * pad / (R * N)            # HSDP: each padded shard all-reduced across the replicas
    m = args.microbatches          # ZeRO-3 gathers every unit for each micro-batch's forward and backward
    dp = {0: 2 * (N - 1) * b * psi / N, 1: 2 * (N - 1) * b * pad / N, 2: 2 * (N - 1) * b * pad / N,
          3: (2 * m + 1) * (N - 1) * b * pad / N}[args.zero]
    rows = args.batch_size // args.dp // args.microbatches            # per micro-batch
    T, C, V = cfg.block_size, cfg.parallel_plan().pipeline.hidden, args.pp * args.chunks
    act = rows * T // (t if args.sp else 1) * C * b_act
    ks = [virtual_stage(c, args.pp, pp_rank) for c in range(args.chunks)]
    pp = args.microbatches * act * sum((k < V - 1) + (k > 0) for k in ks)
    spans = partition_layers(cfg.n_layer, V)
    L = sum(spans[k][1] - spans[k][0] for k in ks)
    S, n_tok = rows * T * C * b_act, rows * T
    ring = (t - 1) / t
    per_mb = (8 * L + 2 * (0 in ks) + 2 * (V - 1 in ks)) * ring * S    # blocks, embedding, head: fwd + bwd
    per_mb += (V - 1 in ks) * 2 * ring * 3 * n_tok * b_act                         # loss: max + [sum, target]
    tp = args.microbatches * per_mb
    if args.sp and t > 1:          # the sequence-partial grads (norms, row biases, positions), once a step
        pats, shapes = cfg.parallel_plan().sequence_partial, cfg.param_shapes()
        partial = sum(math.prod(shapes[n]) for n in set(stage_names(cfg, args, pp_rank))
                      if any(matches(q, n) for q in pats))                  # (mixed: each micro-batch's,
        tp += 2 * ring * partial * (b if args.precision == "fp32" else m * b_act)   # unrounded)
    return {"dp": dp, "dp_rep": dp_rep, "tp": tp if t > 1 else 0.0, "pp": float(pp)}


def main():
    parser, args = parse()
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    layout_for(args, world.size)
    try:
        cfg = lesson.config_from_args(args, -(-tok.vocab_size // args.tp) * args.tp)   # padded to a multiple of tp
    except ValueError as e:
        parser.error(str(e))
    if args.dp * args.tp * args.pp != world.size:
        parser.error(f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} = {args.dp * args.tp * args.pp}, "
                     f"but the job has {world.size} ranks: launch with mpirun -n {args.dp * args.tp * args.pp}")
    if args.batch_size % (args.dp * args.microbatches):
        parser.error(f"--batch-size {args.batch_size} must divide into dp {args.dp} x {args.microbatches} "
                     f"micro-batches")
    sizes = SimpleNamespace(dp_world_size=args.dp, tp_world_size=args.tp, pp_world_size=args.pp)
    try:       # every bad layout: the same usage error on every rank, before any collective
        check_layout(cfg, sizes, args.zero, args.sp, args.schedule, args.microbatches, args.chunks,
                     precision=args.precision)
    except ValueError as e:
        parser.error(str(e))
    mesh = comm.DeviceMesh(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp, pp=args.pp)

    def batch(step):
        return data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)

    check_at = min(args.steps, CHECK_STEPS)
    mixed = args.precision != "fp32"     # one process with dp x m micro-batches rounds alike
    ref_m = args.dp * args.microbatches if mixed else 1
    ref_losses, _ = _reference(cfg, batch, args.seed, args.steps, args.precision, ref_m)
    _, ref_sd = _reference(cfg, batch, args.seed, check_at, args.precision, ref_m)

    # meta init: each rank draws only the pieces it holds (pdist/engine/meta.py)
    model = parallelize(registry.build(cfg, args.seed, device="meta"), mesh, zero_stage=args.zero,
                        sequence_parallel=args.sp, schedule=args.schedule, microbatches=args.microbatches,
                        chunks=args.chunks, precision=args.precision)
    opt = lesson.make_adamw(model.parameters())
    groups = {"dp": mesh.dp_shard_group if args.hybrid else mesh.dp_group,    # HSDP: the shard group's, and
              "dp_rep": mesh.dp_replicate_group if args.hybrid else comm.self_group(),   # the replicas'
              "tp": mesh.tp_group, "pp": mesh.pp_group}
    sent, snap, times = [], {}, []

    rss_step = memory.StepRSS()

    def on_step(step, loss):
        sent.append({k: g.bytes_sent() for k, g in groups.items()})
        for g in groups.values():
            g.reset_stats()
        synchronize()  # the step's device work is done (no-op on CPU)
        times.append(time.perf_counter())
        rss_step.stop()        # the RSS peak since the previous step ended
        rss_step.start()
        if step + 1 == check_at:
            snap["pieces"] = [(pc, np.array(pc.view(pc.tensor.data))) for pc in model.pieces()]

    for g in groups.values():
        g.reset_stats()
    t0 = time.perf_counter()
    losses = train(model, opt, batch, args.steps, on_step=on_step)
    secs = float(np.median(np.diff([t0] + times)))
    b, k = (2, 12) if mixed else (np.dtype(args.dtype).itemsize, None)
    # mixed precision, one micro-batch per rank or one dp rank (a pipeline's m micro-batches too):
    # the rounding points of one process with dp x m micro-batches, so bit for bit at tp = 1, and to
    # a few fp32 ulps at tp > 1 (partial products summed in another order). With dp > 1 and m > 1 a
    # rank rounds its m micro-batches' mean before the dp average (one more rounding, 2^-8
    # relative in bf16): the 2-norm check, at 1e-2
    exact = mixed and (args.microbatches == 1 or args.dp == 1)
    tol = (dict(rtol=0, atol=0) if args.tp == 1 else dict(rtol=1e-6, atol=1e-9)) if exact else \
        dict(rtol=1e-9, atol=1e-12) if args.dtype == "float64" and not mixed else None
    rel_max = 1e-2 if mixed else 1e-3
    pairs = [(a.astype(np.float64), ref_sd[pc.name][box_slices(pc)]) for pc, a in snap["pieces"]]
    sq = np.array([sum(float(np.sum((a - r) ** 2)) for a, r in pairs), sum(float(np.sum(r ** 2)) for a, r in pairs)])
    world.all_reduce(sq)
    rel = float(np.sqrt(sq[0] / sq[1]))
    shards_ok = all(np.allclose(a, r, **tol) for a, r in pairs) if tol else rel <= rel_max
    loss_ok = np.allclose(losses[:check_at], ref_losses[:check_at],
                          rtol=1e-9 if tol else 1e-3 if mixed else 1e-4, atol=0)
    mem = memory.model_state_bytes(model, opt)
    got = (mem["params_bytes"], mem["grads_bytes"], mem["optim_bytes"])
    want = memory_formula(cfg, args, mesh.pp_rank, b, k)
    theory = comm_theory(cfg, args, mesh.coords, b, np.dtype(args.dtype).itemsize)
    per_step = {k: float(np.median([s[k] for s in sent])) for k in groups}
    bytes_ok = all(abs(per_step[k] - theory[k]) <= 64 for k in groups)
    ok = shards_ok and loss_ok and got == want and bytes_ok
    flag = np.array([1.0 if ok else 0.0])
    world.all_reduce(flag, op="min")
    rss = (rss_step.rss_bytes, rss_step.rss_peak_bytes)          # after the last step; that step's peak
    rows = world.all_gather_object((world.rank, tuple(mesh.coords), got, want, per_step, theory, shards_ok,
                                    rss))
    if world.rank == 0:
        report(args, cfg, rows, losses, ref_losses, rel, secs, mesh.placement())
    fb = lesson.fmt_bytes
    runs = [{"name": "mesh", "layout": {"dp": args.dp, "dp_replicate": args.dp_replicate, "dp_shard": args.dp_shard,
                                        "tp": args.tp, "pp": args.pp, "zero_stage": args.zero,
                                        "sequence_parallel": args.sp, "schedule": args.schedule,
                                        "microbatches": args.microbatches, "chunks": args.chunks},
             "dtype": args.dtype, "params": cfg.num_params(), "loss": losses, "baseline_loss": list(ref_losses),
             "memory_per_rank": [dict(rank=r, params_bytes=g[0], grads_bytes=g[1], optim_bytes=g[2],
                                      formula_bytes=list(w), rss_bytes=rs[0], rss_peak_bytes=rs[1])
                                 for r, _, g, w, *_, rs in rows],
             "comm_bytes_per_step": [sum(row[4].values()) for row in rows],
             "comm_bytes_per_group": [dict(row[4], theory=row[5]) for row in rows],
             "node_per_rank": nodes.hosts(), "placement": mesh.placement(),
             "seconds_per_step": secs}]
    lesson.finish("06_mesh", bool(flag[0]), runs, args, rank=world.rank, world_size=world.size,
                  detail=f"(dp {args.dp}{f' = {args.dp_replicate} x {args.dp_shard}' if args.hybrid else ''}"
                         f" x tp {args.tp} x pp {args.pp}, {'HSDP' if args.hybrid else 'ZeRO'}-{args.zero}"
                         f"{', SP' if args.sp and args.tp > 1 else ''}, "
                         f"{args.schedule if args.pp > 1 else 'accumulation'} m={args.microbatches}: "
                         f"every shard equals single-process training, memory = formula, bytes = theory; "
                         f"{fb(sum(rows[0][2]))} of model states on rank 0)")


def _reference(cfg, batch, seed, steps, prec="fp32", microbatches=1):
    """Single-process training through the one loop, on the lesson's batches (bf16/fp16: with
    fp32 masters, their state_dict)."""
    model = Local(precision.cast_module(registry.build(cfg, seed), prec), microbatches)
    if prec != "fp32":
        model = MixedPrecision(model, prec)
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, steps)
    return losses, (model.module.state_dict() if prec == "fp32" else model.full_state_dict())


def report(args, cfg, rows, losses, ref_losses, rel, secs, placement):
    fb = lesson.fmt_bytes
    hy = f" (HSDP: {args.dp_replicate} replicas x {args.dp_shard} shards)" if args.hybrid else ""
    print(f"{args.model} Ψ = {cfg.num_params():,} ({cfg.n_layer} layers, n_embd {cfg.n_embd}, {args.dtype}); mesh "
          f"dp {args.dp}{hy} x tp {args.tp} x pp {args.pp}, ZeRO-{args.zero}, SP {'on' if args.sp else 'off'}, "
          f"{args.schedule} m={args.microbatches} v={args.chunks}; global batch {args.batch_size}, "
          f"{args.steps} steps\n")
    if args.hybrid:      # dp = dp_replicate_rank * dp_shard + dp_shard_rank: the shard group inside, replicas across
        S = args.dp_shard
        print(lesson.table([(r, c[1], c[1] // S, c[1] % S, c[2], c[0], nodes.host(r)) for r, c, *_ in rows],
                           ["world rank", "dp", "dp_replicate", "dp_shard", "tp", "pp", "node"]))
    else:
        print(lesson.table([(r, c[1], c[2], c[0], nodes.host(r)) for r, c, *_ in rows],
                           ["world rank", "dp", "tp", "pp", "node"]))
    if nodes.count() > 1:     # hostnames (pdist/comm/nodes.py): real nodes, or the box's (pdist.cluster)
        on = "; ".join(f"{h}: ranks {', '.join(str(r) for r in range(len(nodes.hosts())) if nodes.host(r) == h)}"
                       for h in nodes.names())
        where = ", ".join(f"{axis} {w}" for axis, w in placement.items())
        print(f"{nodes.count()} nodes ({on}); rank 0's groups: {where or 'none'}")
    print()
    table = []
    for r, c, got, want, ps, th, ok, rss in rows:
        table.append((r, fb(got[0]), fb(got[1]), fb(got[2]), fb(sum(want)), "yes" if got == tuple(want) else "NO",
                      fb(rss[0] or 0), fb(rss[1] or 0), fb(ps["dp"]), fb(th["dp"]),
                      *((fb(ps["dp_rep"]), fb(th["dp_rep"])) if args.hybrid else ()), fb(ps["tp"]),
                      fb(th["tp"]), fb(ps["pp"]), fb(th["pp"]), "yes" if ok else "NO"))
    rep = ["dp_rep sent", "theory"] if args.hybrid else []
    print(lesson.table(table, ["rank", "params", "grads", "optim", "formula", "=", "rss", "rss peak",
                               "dp sent", "theory", *rep, "tp sent", "theory", "pp sent", "theory",
                               "shards = 1 proc"]))
    print(f"\nloss {losses[-1]:.6f} (1 process {ref_losses[-1]:.6f}); |θ - θ_ref| / |θ_ref| = {rel:.1e} after "
          f"{min(args.steps, CHECK_STEPS)} steps; {secs * 1e3:.1f} ms/step\n")


if __name__ == "__main__":
    main()
