"""Cost of the straggler detector (pdist/faults/debug.py) at lesson size.

    mpirun -n 4 python bench/straggler.py [--steps 30] [--every 10]

DDP on 4 ranks, the lessons' GPT (2 layers, 64 wide, 32 tokens, batch 16, float32).
Two costs, measured directly (an A/B of whole step times cannot resolve 1% on a shared
node: step-to-step noise is 10-30%):

* per step: what forward_backward adds (the detector's step hook, pdist/engine/hooks.py:
  five clock reads and reads of the wait counter, one tuple into a deque), timed over
  100000 empty steps through the hooks, less the same steps with the detector off;
* on demand: ``straggler_report(model, last=K)`` (one object all-gather of K records per
  rank and the analysis), timed on every rank, amortized over K steps (``debug.monitor``).

Prints both as a share of the measured median step time (rank 0).
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdist import comm, data  # noqa: E402
from pdist.faults import debug  # noqa: E402
from pdist.engine import hooks  # noqa: E402
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.parallel import DataParallel  # noqa: E402
from pdist.training import train  # noqa: E402


def per_step_overhead(reps=100000):
    """Seconds per step of the detector's hook in forward_backward: ``reps`` steps of four
    empty phases run through the step hooks, detector on less detector off."""
    class Empty:
        steps = 0

    def steps():
        m, x, noop = Empty(), np.zeros(512), (lambda: None)
        t0 = time.perf_counter()
        for s in range(reps):
            m.steps = s
            run = hooks.step(m, x)
            for phase in hooks.PHASES:
                run(phase, noop)
            run.end()
        return (time.perf_counter() - t0) / reps
    on = steps()
    debug.disable()
    off = steps()
    debug.enable()
    return on - off


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    set_default_dtype("float32")
    world = comm.init(timeout=120)
    tokens, tok = data.char_dataset()
    cfg = lesson.gpt_config(tok.vocab_size)
    model = DataParallel(GPT(cfg, 0), world)
    opt = lesson.make_adamw(model.parameters())
    batch = lambda s: data.get_batch(tokens, 16, cfg.block_size, 0, s)  # noqa: E731
    train(model, opt, batch, 2)
    t = []
    train(model, opt, batch, args.steps, start=2, on_step=lambda s, l: t.append(time.perf_counter()))
    step_s = float(np.median(np.diff(t)))
    per = per_step_overhead()
    g = []
    for _ in range(5):
        world.barrier()
        t0 = time.perf_counter()
        debug.straggler_report(model, last=args.every)
        g.append(time.perf_counter() - t0)
    gather_s = float(np.median(g))
    got = world.all_gather_object((step_s, per, gather_s))
    if world.rank == 0:
        step = max(x[0] for x in got)
        per = max(x[1] for x in got)
        gat = max(x[2] for x in got)
        import os
        print(f"conditions: {world.size} ranks on {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d')}, command: mpirun -n {world.size} "
              f"python bench/straggler.py --steps {args.steps} --every {args.every}")
        print(lesson.table([["step (median, slowest rank)", step * 1e3, 100.0],
                            ["detector per step", per * 1e3, 100 * per / step],
                            [f"report every {args.every} steps (amortized)", gat / args.every * 1e3,
                             100 * gat / args.every / step],
                            ["total", (per + gat / args.every) * 1e3, 100 * (per + gat / args.every) / step]],
                           ["", "ms", "% of step"], floatfmt="{:.4f}"))
        ok = (per + gat / args.every) / step < 0.01
        print(f"{'PASS' if ok else 'FAIL'}: the detector costs {100 * (per + gat / args.every) / step:.3f}% of a "
              f"step (< 1%)")
        from machine import report
        report("straggler", {"ranks": world.size, "step_s": step, "detector_s": per, "gather_s": gat,
                             "ok": ok})


if __name__ == "__main__":
    main()
