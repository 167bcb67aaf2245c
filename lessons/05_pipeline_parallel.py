"""Lesson 05 -- pipeline parallelism: GPipe, 1F1B and interleaved 1F1B.

    mpirun -n 4 python lessons/05_pipeline_parallel.py        # p = 4 stages
    python lessons/05_pipeline_parallel.py                    # p = 1 (runs, shows nothing pipelined)

The GPT (8 blocks) is cut into p stages (interleaved: 2p chunks, 2 per rank).
Each step splits the global batch into m micro-batches; a schedule orders the
forwards and backwards on every stage (GPipe: all forwards, then all backwards;
1F1B: one forward, one backward; interleaved: 1F1B over v = 2 chunks per rank).
For each schedule and m the lesson prints the loss beside the single-process
loss, the largest parameter difference after training, each stage's measured
idle fraction ("bubble") beside the plan (unit costs, t_b = 2 t_f) and the
theory (p-1)/(m+p-1), (p-1)/(v m+p-1) interleaved, and the peak number of
micro-batch activations a stage held at once (GPipe m, 1F1B <= p).
On 4 ranks it also trains p = 2 x dp = 2. Then an ASCII picture of one step,
planned and measured (``--png PATH`` also draws it with matplotlib).
"""
import time

import numpy as np

from pdist import comm, data, lesson
from pdist.backend import set_default_dtype
from pdist.parallel import schedules as S
from pdist.parallel.pipeline_draw import ascii_timeline, plot_timeline
from pdist.parallel.pipeline_parallel import gather_timeline, gpt_pipeline, master_name

BATCH = 16


def run_one(cfg, tokens, args, pg, dp_group, schedule, m, v, ref_sd, tol):
    """Train ``args.steps`` steps; this rank's losses, measurements, and its parameters vs the reference."""
    pipe = gpt_pipeline(cfg, args.seed, pg, m, schedule, n_chunks=v, dp_group=dp_group)
    opt = lesson.make_adamw(pipe.parameters())
    groups = [g for g in (pg, dp_group, pipe.emb_group) if g is not None]
    for g in groups:
        g.reset_stats()
    dp_rank, dp = (dp_group.rank, dp_group.size) if dp_group is not None else (0, 1)
    losses, idles, times = [], [], []
    for step in range(args.steps):
        batch = data.get_batch(tokens, BATCH, cfg.block_size, args.seed, step)
        x, y = data.shard(batch, dp_rank, dp)
        t0 = time.perf_counter()
        losses.append(pipe.train_step(x, y, opt, timeline=True))
        times.append(time.perf_counter() - t0)
        tl = gather_timeline(pipe)
        if tl is not None and step > 0:               # step 0 warms caches up
            idles.append(S.bubble_fraction(tl))
    sd = pipe.state_dict()          # compared shard by shard: each stage against its layers of the reference
    diff = max(float(np.max(np.abs(a - ref_sd[master_name(k)]))) for k, a in sd.items())
    close = all(np.allclose(a, ref_sd[master_name(k)], **tol) for k, a in sd.items())
    p_, g_, o_ = (sum(int(q.data.nbytes) for q in pipe.parameters()),
                  sum(int(q.grad.nbytes) for q in pipe.parameters() if q.grad is not None), opt.state_bytes())
    return dict(losses=losses, tl=tl, close=close, idle=np.median(idles, axis=0).tolist() if idles else None,
                seconds=float(np.median(times[1:] or times)), diff=diff, peak_stash=pipe.peak_stash,
                comm=sum(g.bytes_sent() for g in groups) / args.steps, mem=(p_, g_, o_),
                planned=S.simulate(S.make_schedule(schedule, pg.size, m, v)))


def main():
    ap = lesson.parser(__doc__, steps=6, dtype="float64")   # float64: equality to 1e-9 is the check
    ap.add_argument("--png", metavar="PATH", default=None, help="also draw planned vs measured (matplotlib)")
    args = ap.parse_args()
    set_default_dtype(args.dtype)
    world = comm.init()
    n, rank = world.size, world.rank
    pp = n if n <= 4 else 4 if n % 4 == 0 else 1
    tokens, tok = data.char_dataset()
    cfg = lesson.gpt_config(tok.vocab_size, dtype=args.dtype, n_layer=8)
    ref = lesson.train_reference(cfg, args.seed, args.steps, BATCH, tokens) if rank == 0 else None
    ref_losses, ref_sd = world.broadcast_object(ref, src=0)
    mesh = comm.DeviceMesh(dp=n // pp, pp=pp)
    ms = sorted({1, pp, 2 * pp})
    runs = [("gpipe", m, 1, mesh) for m in ms] + [("1f1b", m, 1, mesh) for m in ms]
    runs += [("interleaved", m, 2, mesh) for m in ms if m >= pp]
    if n == 4:
        runs.append(("1f1b", 4, 1, comm.DeviceMesh(dp=2, pp=2)))
    tol = dict(rtol=1e-9, atol=1e-12) if args.dtype == "float64" else dict(rtol=1e-3, atol=1e-4)
    rows, summary, passed, show = [], [], True, None
    for schedule, m, v, msh in runs:
        r = run_one(cfg, tokens, args, msh.pp_group, msh.dp_group, schedule, m, v, ref_sd, tol)
        ok = r["close"] and np.allclose(r["losses"], ref_losses, rtol=tol["rtol"], atol=0)
        every = world.all_gather_object((ok, r["peak_stash"], r["comm"], r["mem"], msh.coords))
        passed &= all(e[0] for e in every)
        stash = [e[1] for e in every if e[4].dp == 0]          # world ranks are pp-major: stage order
        p, dp = msh.pp_world_size, msh.dp_world_size
        name = f"{schedule} m={m}" + (f" v={v}" if v > 1 else "") + (f" pp{p}xdp{dp}" if dp > 1 else "")
        planned = S.bubble_fraction(r["planned"])[0]
        theory = S.theoretical_bubble(p, m, v)
        idle = r["idle"] if rank == 0 else None
        plan_peak = S.check_schedule(S.make_schedule(schedule, p, m, v), m)
        rows.append([name, f"{r['losses'][-1]:.6f}", f"{ref_losses[-1]:.6f}", f"{r['diff']:.1e}",
                     " ".join(f"{x:.0%}" for x in idle) if idle else "-", f"{planned:.0%}",
                     f"{theory:.0%}" if theory is not None else "n/a",
                     "/".join(map(str, stash)), "/".join(map(str, plan_peak)),
                     f"{r['seconds'] * 1e3:.0f}"])
        psi = sum(int(np.prod(shape)) for shape in cfg.param_shapes().values())
        summary.append({"name": name, "layout": {"dp": dp, "tp": 1, "pp": p, "zero_stage": 0},
                        "dtype": args.dtype, "params": psi,
                        "loss": r["losses"], "baseline_loss": list(ref_losses),
                        "memory_per_rank": [{"rank": i, "params_bytes": e[3][0], "grads_bytes": e[3][1],
                                             "optim_bytes": e[3][2]} for i, e in enumerate(every)],
                        "comm_bytes_per_step": [e[2] for e in every], "seconds_per_step": r["seconds"],
                        "schedule": schedule, "microbatches": m, "chunks": v,
                        "bubble": {"measured_per_stage": idle, "planned": planned, "theory": theory},
                        "check": "PASS" if all(e[0] for e in every) else "FAIL",
                        "peak_stash_per_rank": [e[1] for e in every], "peak_stash_planned": plan_peak})
        if schedule == "1f1b" and m == 2 * pp and dp == n // pp:
            show = (r["planned"], r["tl"])
    if rank == 0:
        print(f"GPT {cfg.n_layer} blocks, C={cfg.n_embd}, T={cfg.block_size}, global batch {BATCH}, "
              f"{args.steps} AdamW steps, {args.dtype}, world {n}\n")
        print(lesson.table(rows, ["run", "loss", "1-proc loss", "max|dW|", "measured idle/stage",
                                  "planned", "theory", "peak stash", "planned", "ms/step"]))
        planned_tl, measured_tl = show
        print(f"\n1F1B, p={pp}, m={2 * pp}, planned (t_b = 2 t_f):\n{ascii_timeline(planned_tl)}")
        print(f"\nmeasured (last step, {max(e for r_ in measured_tl for _, _, e in r_) * 1e3:.1f} ms):\n"
              f"{ascii_timeline(measured_tl, width=90, legend=False)}\n")
        if args.png:
            plot_timeline([planned_tl, measured_tl], ["1F1B planned (units of t_f)", "measured"], args.png,
                          unit=["t_f", "seconds"])
            print(f"wrote {args.png}")
    lesson.finish("05_pipeline_parallel", passed, summary, args, rank=rank, world_size=n,
                  detail=f"every schedule equals single-process training ({args.dtype})")


if __name__ == "__main__":
    main()
