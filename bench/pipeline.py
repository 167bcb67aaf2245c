"""Pipeline bubble and activation stash: measured beside theory, per schedule.

    mpirun -n 4 python bench/pipeline.py          # p = 4 stages
    python bench/pipeline.py                      # relaunches itself under mpiexec -n 4

For GPipe, 1F1B and interleaved 1F1B (v = 2) and m in {p, 2p, 4p}: the GPT
(8 blocks, C=64, T=32, global batch 32, float32) trains ``--repeats`` timed
steps after one warm-up step. Each step records every stage's forward/backward
spans (clocks aligned at a barrier); a stage's idle fraction is
1 - (its compute time) / (step makespan, first forward start to last backward end).
Columns: theory (p-1)/(v m+p-1); planned = the schedule simulated with unit costs
(t_b = 2 t_f); measured = median over steps of the mean over stages [min..max
stage]; measured t_b/t_f; peak stash (micro-batch activations held at once,
max over stages, measured / planned); median step time.
"""
import os
import sys
import time

import numpy as np

if __name__ == "__main__" and "--child" not in sys.argv and not any(
        v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pdist.testing import mpirun
    n = int(os.environ.get("PDIST_BENCH_RANKS", "4"))
    print(mpirun(n, os.path.abspath(__file__), "--child", *sys.argv[1:], timeout=600), end="")
    sys.exit(0)

from pdist import comm, data  # noqa: E402
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype, synchronize  # noqa: E402
from pdist.parallel.pipeline import schedules as S  # noqa: E402
from pdist.parallel.pipeline import simulate as sim  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.parallel import PipelineParallel  # noqa: E402
from pdist.parallel.pipeline.stats import gather_timeline  # noqa: E402
from pdist.training import train  # noqa: E402


def measure(cfg, tokens, pg, schedule, m, v, repeats):
    pipe = PipelineParallel(GPT(cfg, 0), pg, schedule, microbatches=m, chunks=v)
    opt = lesson.make_adamw(pipe.parameters())
    idle, times, ratio, peak, t0 = [], [], [], [0], [0.0]

    def batch(step):
        pipe.record_timeline = True      # align the stages' clocks at a barrier, keep the spans
        t0[0] = time.perf_counter()
        return data.get_batch(tokens, 32, cfg.block_size, 0, step)

    def on_step(step, loss):
        synchronize()  # the step's device work is done (no-op on CPU)
        dt = time.perf_counter() - t0[0]
        tl = gather_timeline(pipe)
        peak[0] = max(peak[0], max(pg.all_gather_object(pipe.peak_stash)))
        if step == 0 or pg.rank != 0:
            return
        times.append(dt)
        idle.append(sim.bubble_fraction(tl))
        tf = [e - s for r in tl for i, s, e in r if i.op == S.FORWARD]
        tb = [e - s for r in tl for i, s, e in r if i.op == S.BACKWARD]
        ratio.append(np.mean(tb) / np.mean(tf))
    train(pipe, opt, batch, repeats + 1, on_step=on_step)     # the one loop
    peak = peak[0]
    return idle, times, ratio, peak


def main():
    args = [a for a in sys.argv[1:] if a != "--child"]
    repeats = int(args[args.index("--repeats") + 1]) if "--repeats" in args else 5
    set_default_dtype("float32")
    world = comm.init()
    p = world.size
    tokens, tok = data.char_dataset()
    cfg = lesson.gpt_config(tok.vocab_size, n_layer=8)
    rows = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for m in (p, 2 * p, 4 * p):
            if p * v > cfg.n_layer:
                continue
            idle, times, ratio, peak = measure(cfg, tokens, world, schedule, m, v, repeats)
            if world.rank == 0:
                per_step = np.array(idle)                        # (repeats, p)
                med = np.median(per_step.mean(axis=1))
                stage_med = np.median(per_step, axis=0)
                theory = sim.theoretical_bubble(p, m, v)
                planned = sim.bubble_fraction(sim.simulate(S.make_schedule(schedule, p, m, v)))[0]
                plan_peak = max(sim.check_schedule(S.make_schedule(schedule, p, m, v), m))
                rows.append([schedule + (f" v={v}" if v > 1 else ""), m,
                             f"{theory:.1%}" if theory is not None else "n/a", f"{planned:.1%}",
                             f"{med:.1%} [{stage_med.min():.0%}..{stage_med.max():.0%}]",
                             f"{np.median(ratio):.2f}", f"{peak} / {plan_peak}",
                             f"{np.median(times) * 1e3:.1f}"])
    if world.rank == 0:
        from pdist.comm.mpi import cores_available, cooperative
        print(f"pipeline bubble: p={p} ranks on {cores_available()} cores (cooperative waits: {cooperative()}), "
              f"GPT {cfg.n_layer} blocks C={cfg.n_embd} T={cfg.block_size}, batch 32, float32, "
              f"median of {repeats} steps\n")
        print(lesson.table(rows, ["schedule", "m", "theory", "planned", "measured idle [stages]", "t_b/t_f",
                                  "peak stash meas/plan", "ms/step"]))
        from machine import report
        report("pipeline", {"ranks": p, "cooperative": cooperative(), "rows": rows})


if __name__ == "__main__":
    main()
