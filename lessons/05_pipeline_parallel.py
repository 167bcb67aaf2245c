"""Lesson 05 -- pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and the zero-bubble schedules.

    mpirun -n 4 python lessons/05_pipeline_parallel.py        # p = 4 stages
    python lessons/05_pipeline_parallel.py                    # p = 1 (runs, shows nothing pipelined)
    mpirun -n 3 python lessons/05_pipeline_parallel.py --batch-size 12   # p = 3: m in {1, 3, 6}
    mpirun -n 2 python lessons/05_pipeline_parallel.py --precision bf16  # mixed precision (or fp16)

The GPT (8 blocks; --n-layer) is cut into p stages (interleaved: 2p chunks, 2 per rank):
PipelineParallel(GPT(cfg, seed), pp_group, schedule, microbatches=m, chunks=v) keeps
this rank's blocks of the one GPT, and parallelize(GPT(cfg, seed), DeviceMesh(dp, pp),
...) adds data parallelism around it. Each step splits the global batch into m
micro-batches; a schedule orders the forwards and backwards on every stage (GPipe: all
forwards, then all backwards; 1F1B: one forward, one backward; interleaved: 1F1B over
v = 2 chunks per rank). The zero-bubble schedules split each backward into B (the input
gradient, sent to the previous stage at once) and W (the weight gradients, which can
wait and fill the bubble; Qi et al. 2024): ZB-H1 (1F1B's memory, a third of its
bubble), ZB-V and DualPipeV (two chunks per rank in a V: rank 0 holds the first and
the last stage; DeepSeek-AI 2024), each at m = 2p. Every run trains through the one
loop, pdist.training.train. For each schedule and m the lesson prints the loss beside
the single-process loss, the largest parameter difference after training, each stage's
measured idle fraction ("bubble") beside the plan (unit costs t_F = t_B = t_W, so a
whole backward is 2 t_F) and the paper's formula -- (p-1)/(m+p-1), (p-1)/(v m+p-1)
interleaved, (p-1)/(3m+p-1) ZB-H1, (p-1)/(6m+p-1) ZB-V and DualPipeV -- and the peak
number of micro-batch activations a stage held at once, measured and planned (GPipe m,
1F1B <= p; a zero-bubble micro-batch is held from its F until its W; with two chunks a
count is of chunk-activations). On 4 ranks it also trains p = 2 x dp = 2. Then ASCII
pictures of one step: 1F1B planned and measured, the zero-bubble schedules planned
(F forward, I input gradients = B, W weight gradients), ZB-H1 measured (``--png PATH``
also draws them with matplotlib).

``--precision bf16`` (or fp16): bf16 parameters and gradients, fp32 masters (docs/mixed_precision.md).
Each stage scales the loss (fp16), rounds each micro-batch's weight gradients once, sums
them in fp32 and rounds the mean once, as one process with m micro-batches does, and the
tied wte's two parts are summed per micro-batch as one process sums them: so every
run with dp = 1 equals one process with m micro-batches in the same precision bit for bit
(checked: rtol 0). p = 2 x dp = 2 rounds each dp rank's mean before the dp average (one
process with dp x m micro-batches rounds once): checked to a relative 2-norm error of 1e-2.

Every flag is checked before training, on every rank: the batch must split into
dp x m micro-batches for every run, and 2p (interleaved, ZB-V, DualPipeV) stages need
as many blocks.
"""
import importlib.util
import math
import time
from collections import namedtuple

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.measure import memory
from pdist.engine import precision
from pdist.engine.backend import synchronize, to_numpy
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, MixedPrecision, PipelineParallel, check_layout, parallelize
from pdist.parallel.pipeline import schedules as S
from pdist.parallel.pipeline import simulate as sim
from pdist.parallel.layout import box_slices
from pdist.parallel.pipeline.draw import ascii_timeline, plot_timeline
from pdist.parallel.pipeline.stats import gather_timeline
from pdist.training import train

Run = namedtuple("Run", "schedule m v pp dp")
ZERO_BUBBLE = ("zb-h1", "zb-v", "dualpipev")
Sizes = namedtuple("Sizes", "dp_world_size tp_world_size pp_world_size")   # what check_layout reads of a mesh


def plan(n, cfg, batch_size):
    """The runs on n ranks: p = n stages (up to 4), m in {1, p, 2p} for GPipe and 1F1B,
    interleaved (v = 2) for m >= p, ZB-H1, ZB-V and DualPipeV (v = 2) at m = 2p, and on 4
    ranks p = 2 x dp = 2. Raises ValueError (the same on every rank, before any collective)
    when a run cannot train these flags."""
    pp = n if n <= 4 else 4 if n % 4 == 0 else 1
    ms = sorted({1, pp, 2 * pp})
    runs = [Run(s, m, 1, pp, n // pp) for s in ("gpipe", "1f1b") for m in ms]
    runs += [Run("interleaved", m, 2, pp, n // pp) for m in ms if m >= pp]
    runs += [Run(s, 2 * pp, 1 if s == "zb-h1" else 2, pp, n // pp) for s in ZERO_BUBBLE]
    if n == 4:
        runs.append(Run("1f1b", 4, 1, 2, 2))
    need = math.lcm(*(r.dp * r.m for r in runs))
    if batch_size % need:
        raise ValueError(f"--batch-size {batch_size} does not split into dp x m micro-batches for every run "
                         f"on {n} ranks (p = {pp}, m in {ms}): use a batch size divisible by {need}, "
                         f"e.g. --batch-size {need * max(1, round(batch_size / need))}")
    for r in runs:
        try:
            check_layout(cfg, Sizes(r.dp, 1, r.pp), schedule=r.schedule, microbatches=r.m, chunks=r.v)
        except ValueError as e:
            raise ValueError(f"{r.schedule} m={r.m} v={r.v} on p = {r.pp} stages (--n-layer {cfg.n_layer}): "
                             f"{e}") from None
    return pp, runs


def build(cfg, seed, mesh, r, prec="fp32"):
    """The one GPT as a pipeline of mesh.pp_group (x mesh.dp_group); also the PipelineParallel inside.
    One stage (p = 1, v = 1): parallelize would make the micro-batches plain gradient
    accumulation, so the lesson builds the one-stage pipeline itself, to measure it the same way."""
    if r.pp > 1 or r.v > 1:
        model = parallelize(GPT(cfg, seed), mesh, schedule=r.schedule, microbatches=r.m, chunks=r.v,
                            precision=prec)
    else:
        model = PipelineParallel(precision.cast_module(GPT(cfg, seed), prec), mesh.pp_group, r.schedule, r.m,
                                 r.v)
        model = DataParallel(model, mesh.dp_group) if r.dp > 1 else model
        model = MixedPrecision(model, prec) if prec != "fp32" else model
    return model, model.find(PipelineParallel)


def run_one(cfg, tokens, args, mesh, r, ref_sd, tol):
    """Train ``args.steps`` steps through the one loop; this rank's losses, measurements, and
    its pieces vs the same boxes of the reference."""
    model, pipe = build(cfg, args.seed, mesh, r, args.precision)
    opt = lesson.make_adamw(model.parameters())
    groups = [g for g in (mesh.pp_group, mesh.dp_group, pipe.embedding_group) if g is not None]
    for g in groups:
        g.reset_stats()
    idles, times, tl = [], [], [None]

    def batch(step):
        pipe.record_timeline = True                 # ranks align at a barrier; the step keeps its spans
        times.append(-time.perf_counter())
        return data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)

    def on_step(step, loss):
        synchronize()  # the step's device work is done (no-op on CPU)
        times[-1] += time.perf_counter()
        tl[0] = gather_timeline(pipe)               # on pp rank 0, None elsewhere
        if tl[0] is not None and step > 0:          # step 0 warms caches up
            idles.append(sim.bubble_fraction(tl[0]))

    losses = train(model, opt, batch, args.steps, on_step=on_step)
    sent = sum(g.bytes_sent() for g in groups) / args.steps           # (before the check's all-reduce)
    pairs = [(to_numpy(p.view(p.tensor.data)), ref_sd[p.name][box_slices(p)]) for p in model.pieces()]
    params = sum(int(q.data.nbytes) for q in model.parameters())
    mem = (params, params, opt.state_bytes())                       # grads: one per parameter, its shape
    if args.precision != "fp32":                                    # low params and grads, fp32 masters
        row = memory.model_state_bytes(model, opt)
        mem = (row["params_bytes"], row["grads_bytes"], row["optim_bytes"])
    if tol is None:            # mixed precision, dp > 1 and m > 1: the relative 2-norm (docstring)
        sq = np.array([sum(float(np.sum((a - b) ** 2)) for a, b in pairs),
                       sum(float(np.sum(b ** 2)) for _, b in pairs)])
        mesh.pp_group.all_reduce(sq)
        close = bool(np.sqrt(sq[0] / sq[1]) <= 1e-2)
    else:
        close = all(np.allclose(a, b, **tol) for a, b in pairs)
    return dict(losses=losses, tl=tl[0], idle=np.median(idles, axis=0).tolist() if idles else None,
                close=close,
                diff=max(float(np.max(np.abs(a - b))) for a, b in pairs),
                seconds=float(np.median(times[1:] or times)), peak_stash=pipe.peak_stash,
                comm=sent,
                mem=mem,
                planned=sim.simulate(S.make_schedule(r.schedule, r.pp, r.m, r.v)))


def record(r, res, every, ref_losses, cfg, args, rank):
    """The table row and the JSON record of one run (``every``: each rank's gathered facts)."""
    name = (f"{r.schedule} m={r.m}" + (f" v={r.v}" if r.v > 1 else "")
            + (f" pp{r.pp}xdp{r.dp}" if r.dp > 1 else ""))
    ok = all(e[0] for e in every)
    stash = [e[1] for e in every if e[4].dp == 0]          # world ranks are pp-major: stage order
    planned = sim.bubble_fraction(res["planned"])[0]
    theory = sim.theoretical_bubble(r.pp, r.m, r.v, schedule=r.schedule)
    idle = res["idle"] if rank == 0 else None
    plan_peak = sim.check_schedule(S.make_schedule(r.schedule, r.pp, r.m, r.v), r.m)
    row = [name, f"{res['losses'][-1]:.6f}", f"{ref_losses[-1]:.6f}", f"{res['diff']:.1e}",
           " ".join(f"{x:.0%}" for x in idle) if idle else "-", f"{planned:.0%}",
           f"{theory:.0%}" if theory is not None else "n/a",
           "/".join(map(str, stash)), "/".join(map(str, plan_peak)), f"{res['seconds'] * 1e3:.0f}"]
    rec = {"name": name, "layout": {"dp": r.dp, "tp": 1, "pp": r.pp, "zero_stage": 0},
           "dtype": args.dtype, "precision": args.precision, "params": cfg.num_params(),
           "loss": res["losses"], "baseline_loss": list(ref_losses),
           "memory_per_rank": [{"rank": i, "params_bytes": e[3][0], "grads_bytes": e[3][1],
                                "optim_bytes": e[3][2]} for i, e in enumerate(every)],
           "comm_bytes_per_step": [e[2] for e in every], "seconds_per_step": res["seconds"],
           "schedule": r.schedule, "microbatches": r.m, "chunks": r.v,
           "bubble": {"measured_per_stage": idle, "planned": planned, "theory": theory},
           "check": "PASS" if ok else "FAIL",
           "peak_stash_per_rank": [e[1] for e in every], "peak_stash_planned": plan_peak}
    return row, rec, ok


def report(rows, show, pp, cfg, args, n):
    print(f"GPT {cfg.n_layer} blocks, C={cfg.n_embd}, T={cfg.block_size}, global batch {args.batch_size}, "
          f"{args.steps} AdamW steps, {args.dtype}, world {n}\n")
    print(lesson.table(rows, ["run", "loss", "1-proc loss", "max|dW|", "measured idle/stage",
                              "planned", "theory", "peak stash", "planned", "ms/step"]))
    planned_tl, measured_tl = show["1f1b"]
    print(f"\n1F1B, p={pp}, m={2 * pp}, planned (t_b = 2 t_f):\n{ascii_timeline(planned_tl)}")
    print(f"\nmeasured (last step, {max(e for r_ in measured_tl for _, _, e in r_) * 1e3:.1f} ms):\n"
          f"{ascii_timeline(measured_tl, width=90, axis='ms')}\n")
    zb_planned, zb_measured = show["zb-h1"]
    print(f"ZB-H1, p={pp}, m={2 * pp}, planned (t_F = t_B = t_W; I = B, the input gradients):\n"
          f"{ascii_timeline(zb_planned)}")
    print(f"\nmeasured (last step, {max(e for r_ in zb_measured for _, _, e in r_) * 1e3:.1f} ms):\n"
          f"{ascii_timeline(zb_measured, width=90, axis='ms')}\n")
    for name, title in (("zb-v", "ZB-V"), ("dualpipev", "DualPipeV")):   # m = p: a picture that fits
        print(f"{title}, p={pp}, m={pp}, planned (chunk a: stage s, chunk b: stage 2p-1-s, a V):\n"
              f"{ascii_timeline(sim.simulate(S.make_schedule(name, pp, pp)), cols_per_unit=3)}\n")
    if args.png:
        plot_timeline([planned_tl, measured_tl, zb_planned, zb_measured],
                      ["1F1B planned (units of t_f)", "1F1B measured", "ZB-H1 planned", "ZB-H1 measured"],
                      args.png, unit=["t_f", "seconds", "t_f", "seconds"])
        print(f"wrote {args.png}")


def main():
    # float64: equality to 1e-9 is the check
    ap = lesson.parser(__doc__, steps=6, dtype="float64", batch_size=16, n_layer=8, precision=True)
    ap.add_argument("--png", metavar="PATH", default=None, help="also draw planned vs measured (matplotlib)")
    args = lesson.validate(ap, ap.parse_args())
    if args.png and importlib.util.find_spec("matplotlib") is None:   # fail now, not after the run
        ap.error("--png needs matplotlib: .venv/bin/pip install 'pdist[plots]' (or leave out --png)")
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    n, rank = world.size, world.rank
    cfg = lesson.config_from_args(args, tok.vocab_size)
    try:  # every run's layout and batch, checked on every rank before any training
        pp, runs = plan(n, cfg, args.batch_size)
    except ValueError as e:
        ap.error(f"[rank {rank}] {e}")
    mixed = args.precision != "fp32"     # one process with dp x m micro-batches, in the same precision
    refs = {k: lesson.train_reference(cfg, args.seed, args.steps, args.batch_size, tokens, args.precision, k)
            for k in sorted({r.dp * r.m if mixed else 1 for r in runs})} if rank == 0 else None
    refs = world.broadcast_object(refs, src=0)
    meshes = {k: comm.DeviceMesh(dp=k[1], pp=k[0]) for k in dict.fromkeys((r.pp, r.dp) for r in runs)}
    tol = dict(rtol=1e-9, atol=1e-12) if args.dtype == "float64" else dict(rtol=1e-3, atol=1e-4)
    if mixed:
        tol = dict(rtol=0, atol=0)         # the same rounding points as one process: bit for bit
    rows, summary, passed, show = [], [], True, {}
    for r in runs:
        mesh = meshes[(r.pp, r.dp)]
        ref_losses, ref_sd = refs[r.dp * r.m if mixed else 1]
        nested = mixed and r.dp > 1 and r.m > 1                  # another rounding grouping
        res = run_one(cfg, tokens, args, mesh, r, ref_sd, None if nested else tol)
        loss_rtol = 1e-3 if nested else 1e-12 if mixed else tol["rtol"]   # (mixed: float64 sums, other order)
        ok = res["close"] and np.allclose(res["losses"], ref_losses, rtol=loss_rtol, atol=0)
        every = world.all_gather_object((ok, res["peak_stash"], res["comm"], res["mem"], mesh.coords))
        row, rec, ok = record(r, res, every, ref_losses, cfg, args, rank)
        rows.append(row)
        summary.append(rec)
        passed &= ok
        if r.schedule in ("1f1b", "zb-h1") and r.m == 2 * pp and r.pp == pp:
            show[r.schedule] = (res["planned"], res["tl"])
    if rank == 0:
        report(rows, show, pp, cfg, args, n)
    lesson.finish("05_pipeline_parallel", passed, summary, args, rank=rank, world_size=n,
                  detail=f"every schedule equals single-process training ({args.dtype}"
                         + (f", {args.precision}: bit for bit; pp x dp to a 2-norm of 1e-2)" if mixed else ")"))


if __name__ == "__main__":
    main()
