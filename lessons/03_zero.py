"""Lesson 03 -- ZeRO: shard the optimizer states, then the gradients, then the
parameters (Rajbhandari et al., 2020), FSDP-style (pdist/parallel/zero/zero.py).

    mpirun -n 4 python lessons/03_zero.py              # stages 0, 1, 2, 3 side by side
    mpirun -n 4 python lessons/03_zero.py --stage 3    # one stage
    python lessons/03_zero.py                          # one rank: nothing to shard, same numbers
    mpirun -n 4 python lessons/03_zero.py --precision bf16   # also the paper's own mixed-precision table
    mpirun -n 4 python lessons/03_zero.py --dp-shard 2       # HSDP: 2-way shards, 2 replicas

``--dp-shard S`` (S dividing the world's n ranks) is hybrid sharding (HSDP,
pdist/parallel/zero/hsdp.py; MiCS, Zhang et al. 2022; PyTorch FSDP's HYBRID_SHARD): stages
1-3 shard over groups of S consecutive ranks (one node) and keep R = n/S replicas of each
shard; each unit's gradient is reduce-scattered inside the shard group, then each shard
all-reduced across the R replicas. Memory is ZeRO's with N = S; the table prints each
group's bytes beside its formula: inside, ZeRO's with N = S; across, 2(R-1)/R·bΨ_pad/S.
Stage 0 stays plain data parallelism over all n ranks.

``--precision bf16`` (or fp16) prints a second table: bf16 params and grads, fp32 master, m
and v (K = 12), so the formulas are the paper's literally: stage 0 16Ψ, 1 4Ψ+12Ψ/N, 2
2Ψ+14Ψ/N, 3 16Ψ/N; its check is bit-for-bit against one process with N micro-batches in
the same precision (docs/mixed_precision.md).

Every stage trains the same GPT on the same global batches as single-process
training (pdist.course.lesson.train_reference), through the same loop (pdist.training.train):

    model = ZeRO(GPT(cfg, seed), stage, world)        # parameters(): this rank's flat shards
    opt = lesson.make_adamw(model.parameters())
    train(model, opt, lambda step: data.get_batch(tokens, B, T, seed, step), steps)

and must end with its weights (to rounding): each rank checks its pieces of the
model (``model.pieces()``: where each shard sits in the single-process tensors)
against the same slices of the baseline. Stages 1 and 2 all-gather the updated
parameters at the start of the next step (FSDP-style), so every step sends
reduce-scatter + all-gather.

The table (per rank; every rank holds the same amounts, see --json for all):
  params / grads / optim   bytes of live parameters, gradients and AdamW states
                           (m, v), measured (pdist.measure.memory: each buffer once)
  total, formula           their sum, and the ZeRO paper's formula. Convention:
                           one dtype of b bytes (4 in float32) with Adam, so the
                           paper's 16Ψ reads params 4Ψ + grads 4Ψ + m, v 8Ψ:
                           stage 0 16Ψ, 1 8Ψ+8Ψ/N, 2 4Ψ+12Ψ/N, 3 16Ψ/N (float64:
                           twice that). Stages 1-3 pad each unit to a multiple of
                           N: Ψ there is Ψ_pad = Σ_units ceil(Ψ_u/N)·N
  sent/step, theory        bytes this rank sent per step (ProcessGroup.stats,
                           ring accounting) and the theory: 2(N-1)/N·bΨ ("2Ψ")
                           for stages 0-2, 3(N-1)/N·bΨ ("3Ψ") for stage 3
  peak                     the most bytes allocated at once during a step
                           (tracemalloc; model states + activations + temporaries)
  ms/step                  median step time (rank 0)
  loss, baseline           final loss (mean over ranks) and the single-process one
  rel err                  |θ - θ_ref| / |θ_ref| over all pieces of all ranks (2-norms)
                           after min(--steps, 10) steps

The second table is what each process holds (the OS's count, per rank, MiB):
  baseline       RSS before the stage's model is built (after malloc returns its free
                 pages): the interpreter, NumPy, MPI, the corpus, and the reference
                 weights the check compares against
  init peak      the RSS peak while ZeRO(GPT(cfg, seed, device="meta")) is built, above the
                 baseline: each rank draws only its pieces (pdist/engine/meta.py), so stage 3
                 peaks at its shard + about the largest parameter, not the whole model
  rss            RSS after the last step; malloc held: the resident pages malloc keeps
                 free for the next step's temporaries (rss - trimmed; glibc's own count of
                 free heap, mallinfo2, also counts reserved pages never touched: in the JSON)
  trimmed        RSS after malloc_trim(0) returned those free pages: the live memory;
                 base+formula is baseline + the formula's model states, Δ the difference
  rss peak       the peak RSS during the last step; base+peak is baseline + the traced
                 peak (states + activations + temporaries), Δ the difference
--check-rss (on by default from Ψ = 4 M: below it the baseline hides the model, e.g.
--n-layer 8 --n-embd 512 --n-head 8 --batch-size 4 gives Ψ = 25.3 M) adds to PASS:
|trimmed - (base+formula)| and |rss peak - (base+peak)| <= 15% of the prediction on
every rank (fp32 only: in bf16/fp16 the fp32 gradients the optimizer read stay alive
until the next step's zero_grad, docs/mixed_precision.md). --timeline PNG plots each
rank's memory over one step, the states and activations stacked, with every all-gather,
free and reduce-scatter marked; the same events and a "memory" counter go into --trace
(pdist/measure/memory_timeline.py).

PASS means, on every rank: model-state bytes equal the formula exactly, bytes sent
equal the theory, and (as in lesson 02) after min(--steps, 10) steps every shard
equals the same slice of the single-process weights (float64: elementwise, rtol
1e-9, atol 1e-12; float32: relative 2-norm error of the whole model <= 1e-4, as AdamW
turns the rounding noise of a gradient that is ~0 (e.g. the key bias, whose true
gradient is exactly 0) into steps of size lr: single elements differ by up to
~3e-4 after 5 steps) and so do the losses of those steps (rtol 1e-9 / 1e-5).
Why stop at 10: summing a gradient in another order is a 1e-16 relative
difference that training amplifies over many steps (lesson 02 and docs/zero.md).
"""
import argparse
import gc
import os
import time

import numpy as np

from pdist.engine import host_memory, precision
from pdist import comm, data
from pdist.course import lesson
from pdist.measure import memory, memory_timeline
from pdist.engine.backend import synchronize, to_numpy
from pdist.models.gpt import GPT
from pdist.parallel import MixedPrecision, ZeRO
from pdist.parallel.zero import HSDP
from pdist.parallel.layout import box_slices
from pdist.training import train

FORMULA = {0: "16Ψ", 1: "8Ψ+8Ψ/N", 2: "4Ψ+12Ψ/N", 3: "16Ψ/N"}  # in float32 (b = 4)
FORMULA_MIXED = {0: "16Ψ", 1: "4Ψ+12Ψ/N", 2: "2Ψ+14Ψ/N", 3: "16Ψ/N"}  # the paper's: 2 + 2 + K = 12
COMM = {0: "2Ψ·(N-1)/N", 1: "2Ψ·(N-1)/N", 2: "2Ψ·(N-1)/N", 3: "3Ψ·(N-1)/N"}  # ring accounting
RSS_TOL = 0.15          # |RSS - prediction| / prediction, when the RSS is checked
RSS_CHECK_MIN_PSI = 4_000_000   # checked by default from here: below, the baseline hides the model
CHECK_STEPS = 10   # horizon of the tight shard check (why: lessons/02_data_parallel.py's docstring)
F32_REL = 1e-4     # float32: |θ - θ_ref| / |θ_ref| over the whole model (all shards)


def formula_bytes(stage, psi, n, b, k=None):
    """(params, grads, optim) bytes per rank from the ZeRO paper: params and grads of b bytes,
    optimizer states of k bytes per parameter (one dtype with Adam: k = 2b; mixed
    precision: b = 2, k = 12, fp32 master + m + v)."""
    k = 2 * b if k is None else k
    return {0: (b * psi, b * psi, k * psi),
            1: (b * psi, b * psi, k * psi // n),
            2: (b * psi, b * psi // n, k * psi // n),
            3: (b * psi // n, b * psi // n, k * psi // n)}[stage]


def group_theory(stage, z, b):
    """{group: bytes sent per step per rank}: ZeRO over the world {"dp": ...}; HSDP
    {"shard": ZeRO's with N = S, "replicate": 2(R-1)/R·bΨ_pad/S}."""
    if not isinstance(z, HSDP):
        return {"dp": comm_theory(stage, z, z.group.size, b)}
    S, R = z.group.size, z.replicate_group.size
    return {"shard": comm_theory(stage, z, S, b), "replicate": 2 * (R - 1) * b * z.numel_padded / (R * S)}


def group_sizes(z, n, mesh):
    """{group: ranks} for the table with --dp-shard (None without)."""
    if mesh is None:
        return None
    return {"dp": n, "shard": z.group.size, "replicate": getattr(z, "replicate_group", z.group).size}


def groups_of(z, world):
    """The groups whose bytes the table counts: the world, or HSDP's shard and replicate groups."""
    return {"shard": z.group, "replicate": z.replicate_group} if isinstance(z, HSDP) else {"dp": world}


def comm_theory(stage, z, n, b):
    """Bytes sent per step per rank, ring accounting: all-reduce 2(n-1)/n S per unit
    (stage 0), reduce-scatter + all-gather (n-1)/n S each (1, 2), + one more all-gather (3)."""
    if stage == 0:
        return sum(2 * (n - 1) * b * u.numel / n for u in z.units)
    return (2 if stage < 3 else 3) * (n - 1) * b * z.numel_padded / n


def rss_prediction(rss, states, peak):
    """What the process should hold: (baseline + the formula's model states after a step,
    baseline + the traced peak of a step: states + activations + temporaries)."""
    base = rss["rss_baseline_bytes"] or 0
    return base + states, base + (peak or 0)


def rss_close(rss, pred):
    """True when the RSS (malloc's free pages returned) and the step's peak RSS are within
    RSS_TOL of the prediction (False without /proc)."""
    got = (rss.get("rss_trimmed_bytes"), rss.get("rss_peak_bytes"))
    return all(g is not None and abs(g - w) <= RSS_TOL * w for g, w in zip(got, pred))


def _held(m):
    """Resident pages malloc keeps free: RSS minus RSS after malloc_trim(0) (None without /proc)."""
    got = (m.get("rss_bytes"), m.get("rss_trimmed_bytes"))
    return None if None in got else got[0] - got[1]


def rss_row(m):
    """One row of the RSS table, in MiB, from a memory_per_rank entry."""
    mib = (lambda v: "n/a" if v is None else f"{v / 2**20:.1f}")
    rel = (lambda g, w: "n/a" if g is None else f"{(g - w) / w:+.1%}")
    base = m["rss_baseline_bytes"] or 0
    return [m["rank"], mib(base), mib(m["rss_init_peak_bytes"] - base), mib(m["rss_bytes"]),
            mib(_held(m)), mib(m["rss_trimmed_bytes"]), mib(m["rss_prediction_bytes"]),
            rel(m["rss_trimmed_bytes"], m["rss_prediction_bytes"]), mib(m["rss_peak_bytes"]),
            mib(m["rss_peak_prediction_bytes"]), rel(m["rss_peak_bytes"], m["rss_peak_prediction_bytes"])]


def shard_error(z, ref_sd, world, tol):
    """Compare this rank's pieces with the same slices of ``ref_sd``: (ok, |θ - θ_ref| / |θ_ref|)
    over all ranks' pieces (an all-reduce)."""
    pairs = [(to_numpy(p.view(p.tensor.data)).astype(np.float64), np.asarray(ref_sd[p.name])[box_slices(p)])
             for p in z.pieces()]
    sq = np.array([sum(float(np.sum((a - r) ** 2)) for a, r in pairs),
                   sum(float(np.sum(r ** 2)) for a, r in pairs)])
    world.all_reduce(sq)                      # over all ranks' pieces: the whole model
    rel = float(np.sqrt(sq[0] / sq[1]))       # |θ - θ_ref| / |θ_ref|
    return (all(np.allclose(a, r, **tol) for a, r in pairs) if tol else rel <= F32_REL), rel


def build(cfg, stage, world, args, prec):
    """ZeRO-``stage`` over the world from a meta GPT: each rank draws its own pieces only
    (pdist/engine/meta.py); bf16/fp16: the model cast, fp32 masters outside."""
    model = precision.cast_module(GPT(cfg, seed=args.seed, device="meta"), prec)
    m = args.mesh                   # --dp-shard: HSDP (stage 0 stays DDP over the world)
    if m is not None and stage >= 1:
        z = HSDP(model, stage, m.dp_shard_group, m.dp_replicate_group, dp_group=m.dp_group,
                 prefetch=not args.no_prefetch)
        return z if prec == "fp32" else MixedPrecision(z, prec)
    z = ZeRO(model, stage, world, prefetch=not args.no_prefetch)
    return z if prec == "fp32" else MixedPrecision(z, prec)


def run(cfg, stage, world, args, tokens, steps, check_at=None, ref_sd=None, tol=None, prec="fp32"):
    """Train ``steps`` steps under ZeRO-``stage`` with the one loop. After step ``check_at``,
    compare this rank's pieces with ``ref_sd`` (``shard_error``). Returns
    (model, optimizer, losses, bytes sent per step, median seconds per step, (ok, rel err),
    {rss_baseline_bytes (before the model), rss_bytes, rss_peak_bytes (the last step)})."""
    gc.collect()
    host_memory.malloc_trim()      # malloc's free pages (earlier runs' temporaries) back to the OS
    rss = {"rss_baseline_bytes": memory.rss_bytes()}   # before the model: interpreter, libraries, data
    with memory.RSSPeak() as init:     # meta init: each rank draws its own pieces only (pdist/engine/meta.py)
        z = build(cfg, stage, world, args, prec)
    rss["rss_init_peak_bytes"] = init.peak_bytes
    opt = lesson.make_adamw(z.parameters())
    groups = groups_of(z.find(ZeRO), world)
    sent, secs, check, clock = [], [], [(True, 0.0)], [0.0]

    def batch(step):           # the step starts here: counters, clock and RSS peak from zero
        b = data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)
        for g in {id(g): g for g in (world, *groups.values())}.values():
            g.reset_stats()
        memory.reset_rss_peak()
        clock[0] = time.perf_counter()
        return b

    def on_step(step, loss):
        synchronize()  # the step's device work is done (no-op on CPU)
        secs.append(time.perf_counter() - clock[0])
        if step + 1 == steps:      # the last step: peak, RSS, what malloc holds free, RSS without it
            rss.update(rss_peak_bytes=memory.rss_peak_bytes(), rss_bytes=memory.rss_bytes(),
                       malloc_free_bytes=host_memory.malloc_free_bytes())
            host_memory.malloc_trim()
            rss["rss_trimmed_bytes"] = memory.rss_bytes()
        sent.append({k: g.bytes_sent() for k, g in groups.items()})
        if step + 1 == check_at:   # (after reading the step's bytes: this all-reduce is not counted)
            check[0] = shard_error(z, ref_sd, world, tol)

    losses = train(z, opt, batch, steps, on_step=on_step)
    return z, opt, losses, sent, float(np.median(secs)), check[0], rss


GROUP_COMM = {"dp": lambda st: COMM[st], "shard": lambda st: COMM[st].replace("N", "S"),
              "replicate": lambda st: "2Ψ/S·(R-1)/R"}
GROUP_NAME = {"dp": "all", "shard": "shard", "replicate": "replicas"}


def comm_rows(stage, per, theory, tail, sizes=None):
    """A stage's rows of the bytes table (mean over ranks): sent beside theory, then ``tail`` (loss,
    baseline, rel err, ms/step). With --dp-shard (``sizes``: {group: ranks}), one row per group,
    named with its size (the world's at stage 0), ``tail`` on the first."""
    def cell(g):
        return [lesson.fmt_bytes(np.mean([p[g] for p in per])), f"{GROUP_COMM[g](stage)} = {lesson.fmt_bytes(theory[g])}"]
    if sizes is None:
        return [[stage, *cell("dp"), *tail]]
    return [[stage if i == 0 else "", f"{GROUP_NAME[g]} ({sizes[g]})", *cell(g), *(tail if i == 0 else [""] * len(tail))]
            for i, g in enumerate(theory)]


def peak_bytes(cfg, stage, world, args, tokens, prec):
    """The peak of one step (step 0's batch) after 2 traced steps from a fresh model
    (tracemalloc slows NumPy's allocations, so the timed run is not traced). The same
    step's memory timeline (pdist/measure/memory_timeline.py) goes into the trace, and with
    --timeline into a PNG."""
    memory.start_tracing(restart=True)
    zm, om, *_ = run(cfg, stage, world, args, tokens, min(2, args.steps), prec=prec)
    with memory.PeakMemory() as pk, memory_timeline.record(zm, om) as tl:
        train(zm, om, lambda step: data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, 0), 1)
    memory.stop_tracing()
    if args.timeline:          # every rank's samples of this step, one PNG (rank 0)
        per_rank = world.all_gather_object(tl.samples)
        tag = f".zero{stage}" if args.stage is None else ""
        tag += f".{prec}" if args.precision != "fp32" else ""
        path = f"{os.path.splitext(args.timeline)[0]}{tag}.png" if tag else args.timeline
        title = f"ZeRO-{stage}, {prec}: one step, {world.size} ranks"
        if world.rank == 0 and not memory_timeline.plot(per_rank, path, title):
            print("--timeline: matplotlib is not installed (pip install 'pdist[plot]'): no PNG written")
    return pk.peak_bytes


def print_tables(rows, rss_rows, check_rss, hybrid=False):
    """Rank 0's tables, each at most 100 characters wide: memory per rank against the formula;
    bytes sent, loss and time per step (with --dp-shard: each group's, the shard group's, then
    the replicas', at stage 0 the world's); what each process holds (RSS, in MiB)."""
    print("Memory per rank (rank 0), against the formula:")
    print(lesson.table([m for m, _ in rows], ["stage", "params", "grads", "optim", "total", "formula",
                                              "=", "peak"]))
    print("\nBytes sent per step (mean over ranks) against the ring's theory; "
          "the loss beside one process's:")
    cols = ["group", "sent/step", "theory"] if hybrid else ["sent/step", "theory"]
    print(lesson.table([r for _, c in rows for r in c], ["stage", *cols, "loss", "baseline", "rel err", "ms/step"]))
    print(f"\nWhat each process holds (RSS, the OS's count, in MiB; the last step; "
          f"{'checked: within ' + format(RSS_TOL, '.0%') if check_rss else 'not checked here'}):")
    print(lesson.table([r[:9] for r in rss_rows], ["stage", "rank", "baseline", "init peak", "rss",
                                                   "malloc held", "trimmed", "base+formula", "Δ"]))
    print("\n... and its peak, against baseline + the traced peak:")
    print(lesson.table([r[:2] + r[9:] for r in rss_rows], ["stage", "rank", "rss peak", "base+peak", "Δ"]))
    print()


def one_precision(cfg, prec, stages, world, args, tokens, check_rss):
    """Every stage in one precision: the tables (rank 0), and (the JSON's runs, PASS on every rank)."""
    n, rank, mixed = world.size, world.rank, prec != "fp32"
    b, k = (2, 12) if mixed else (np.dtype(args.dtype).itemsize, None)
    # the check (as lesson 02's): shards after min(steps, 10) steps and the losses of those steps;
    # mixed precision: the single process with n micro-batches rounds where the ranks do: exact
    check_at = min(args.steps, CHECK_STEPS)
    tol = dict(rtol=0, atol=0) if mixed else dict(rtol=1e-9, atol=1e-12) if args.dtype == "float64" else None
    loss_rtol = 1e-9 if args.dtype == "float64" or mixed else 1e-5
    ref = dict(tokens=tokens, precision=prec, microbatches=n if mixed else 1)
    baseline, _ = lesson.train_reference(cfg, args.seed, args.steps, args.batch_size, **ref)
    _, ref_sd = lesson.train_reference(cfg, args.seed, check_at, args.batch_size, **ref)

    rows, rss_rows, runs, ok_all = [], [], [], True
    name = args.dtype if not mixed else f"{prec} params and grads, fp32 masters, compute in {args.dtype}"
    for stage in stages:
        peak = peak_bytes(cfg, stage, world, args, tokens, prec)
        model, opt, losses, sent, sps, (shards_ok, err), rss = run(cfg, stage, world, args, tokens,
                                                                    args.steps, check_at, ref_sd, tol, prec)
        mem = memory.memory_row(rank, model, opt, peak, rss)
        z = model.find(ZeRO)
        psi = z.numel if stage == 0 else z.numel_padded
        want = formula_bytes(stage, psi, z.group.size, b, k)       # N: the ranks a shard is cut over
        theory = group_theory(stage, z, b)
        got = (mem["params_bytes"], mem["grads_bytes"], mem["optim_bytes"])
        rss_pred = rss_prediction(rss, sum(want), peak)
        mem.update(rss_prediction_bytes=rss_pred[0], rss_peak_prediction_bytes=rss_pred[1])
        rss_ok = not check_rss or rss_close(rss, rss_pred)
        loss_ok = np.allclose(losses[:check_at], baseline[:check_at], rtol=loss_rtol, atol=0)
        ok = (shards_ok and loss_ok and got == want and rss_ok
              and all(abs(s[g] - theory[g]) <= len(z.units) for s in sent for g in theory))
        flag = np.array([1.0 if ok else 0.0])
        world.all_reduce(flag, op="min")                            # PASS only if every rank passed
        ok_all &= bool(flag[0])
        mean = {g: float(np.mean([s[g] for s in sent])) for g in theory}    # this rank, per group
        mems, per = world.all_gather_object(mem), world.all_gather_object(mean)
        hybrid = isinstance(z, HSDP)
        run_ = {"name": f"{'hsdp' if hybrid else 'zero'}{stage}" + (f"_{prec}" if mixed else ""),
                "layout": {"dp": n, "tp": 1, "pp": 1, "zero_stage": stage}}
        if hybrid:
            run_["layout"].update(dp_replicate=z.replicate_group.size, dp_shard=z.group.size)
            run_["comm_bytes_per_group"] = {g: {"sent": [p[g] for p in per], "theory": theory[g]} for g in theory}
        runs.append({**run_,
                     "dtype": args.dtype, "precision": prec,
                     "params": z.numel, "params_padded": z.numel_padded,
                     "loss": list(losses), "baseline_loss": list(baseline), "memory_per_rank": mems,
                     "comm_bytes_per_step": [sum(p.values()) for p in per],
                     "comm_bytes_theory": sum(theory.values()),
                     "memory_formula": dict(zip(("params_bytes", "grads_bytes", "optim_bytes"), want)),
                     "seconds_per_step": sps, "rss_checked": check_rss})
        fb = lesson.fmt_bytes
        formula = FORMULA_MIXED[stage] if mixed else FORMULA[stage] if b == 4 else "2x " + FORMULA[stage]
        rows.append(([stage, fb(got[0]), fb(got[1]), fb(got[2]), fb(sum(got)),
                      f"{formula.replace('N', 'S') if hybrid else formula} = {fb(sum(want))}",
                      "yes" if got == want else "NO", fb(peak)],
                     comm_rows(stage, per, theory, [f"{losses[-1]:.6f}", f"{baseline[-1]:.6f}", f"{err:.1e}",
                                                    f"{sps * 1e3:.1f}"], group_sizes(z, n, args.mesh))))
        rss_rows += [[stage] + rss_row(m) for m in mems]
        numel, numel_padded, n_units = z.numel, z.numel_padded, len(z.units)
        del model, z, opt      # the next stage's baseline RSS must not hold this one's model

    if rank == 0:
        m = args.mesh
        hsdp = (f"  HSDP, stages 1-3: R = {m.dp_replicate_world_size} replicas x S = {m.dp_shard_world_size}-way "
                f"shards (N = S); stage 0: all-reduce over all {n}\n") if m is not None else ""
        print(f"ZeRO on {n} rank(s): GPT with Ψ = {numel:,} parameters, Ψ_pad = {numel_padded:,}, "
              f"AdamW, {args.steps} steps, global batch {args.batch_size}\n{hsdp}"
              f"  {n_units} flat units: root wte+wpe, {cfg.n_layer} blocks, ln_f\n"
              f"  {name} (b = {b}{', K = 12' if mixed else ''})\n")
        print_tables(rows, rss_rows, check_rss, m is not None)
    return runs, ok_all


def hsdp_words(m):
    return f", HSDP {m.dp_replicate_world_size} x {m.dp_shard_world_size}" if m is not None else ""


def hybrid_mesh(p, args, n):
    """--dp-shard S: the DeviceMesh(dp_replicate=n/S, dp_shard=S) of HSDP, or None (no flag, or S = n:
    one shard group, plain ZeRO). Bad values stop every rank here, before any collective."""
    S = args.dp_shard
    if S is None:
        return None
    if S < 1 or n % S:
        p.error(f"--dp-shard {S} must be a positive divisor of the {n} ranks (the replicas are {n}/S); "
                f"use one of {[d for d in range(1, n + 1) if n % d == 0]}")
    if args.precision != "fp32":
        p.error(f"--dp-shard with --precision {args.precision}: the mixed-precision table checks one process's "
                f"bits, which assume one reduction over all ranks; use --precision fp32 with --dp-shard")
    return comm.DeviceMesh(dp_replicate=n // S, dp_shard=S) if S < n else None


def main():
    p = lesson.parser(__doc__, batch_size=12, precision=True)
    p.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="one ZeRO stage (0-3); default: all four")
    p.add_argument("--no-prefetch", action="store_true", help="stage 3 without all-gather prefetch")
    p.add_argument("--dp-shard", type=int, default=None, metavar="S",
                   help="HSDP: stages 1-3 shard over groups of S ranks and replicate across the n/S groups "
                        "(S must divide the ranks; float32/float64, --precision fp32); default: shard over all")
    p.add_argument("--timeline", metavar="PNG", default=None,
                   help="plot each rank's memory over one step (params, grads, optimizer, activations "
                        "stacked; all-gather/free/reduce-scatter marked) here; with all stages, one PNG "
                        "per stage (NAME.zeroK.png). Needs matplotlib")
    p.add_argument("--check-rss", action=argparse.BooleanOptionalAction, default=None,
                   help=f"PASS also needs each rank's RSS within {RSS_TOL * 100:.0f}%% of baseline + formula "
                        f"(and its peak of baseline + traced peak); default: on when "
                        f"Ψ >= {RSS_CHECK_MIN_PSI:,}")
    args = lesson.validate(p, p.parse_args())
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    n, rank = world.size, world.rank
    if args.batch_size % n:    # the same on every rank, before any collective
        p.error(f"--batch-size {args.batch_size} does not divide by the {n} ranks; use a multiple of {n}")
    args.mesh = hybrid_mesh(p, args, n)
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]

    cfg = lesson.config_from_args(args, tok.vocab_size)
    check_rss = args.check_rss or (args.check_rss is None and cfg.num_params() >= RSS_CHECK_MIN_PSI)
    runs, ok_all = [], True
    for prec in ["fp32"] + ([args.precision] if args.precision != "fp32" else []):   # both: fp32 first
        r, ok = one_precision(cfg, prec, stages, world, args, tokens, check_rss and prec == "fp32")
        runs += r
        ok_all &= ok
    lesson.finish("03_zero", ok_all, runs, args, rank=rank, world_size=n,
                  detail=f"(stages {stages} on {n} ranks{hsdp_words(args.mesh)}: shards equal the single-process run,\n"
                         f"  memory = formula, bytes = theory)" if ok_all else
                  "(a stage differs from the single-process run, the formula or the theory: see the table)")


if __name__ == "__main__":
    main()
