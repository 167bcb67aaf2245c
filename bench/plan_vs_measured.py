"""The planner's waterfall beside pdist's measured one, on every lesson layout of this machine.

    python bench/plan_vs_measured.py                 # 21 step pairs per layout (default)
    python bench/plan_vs_measured.py --steps 15 --tol 0.15 --floor 0.05

Two launches (tests/workers/plan_measured_worker.py): 2 ranks for dp2, ZeRO-1..3 at dp2, tp2,
pp2 1f1b m4; 4 ranks for dp2 x tp2, alone and on a simulated 2-node topology
(pdist/comm/topology.py; nodes of 2 ranks, intra 2 GB/s 20 us, inter 50 MB/s 1 ms) with tp
inside the nodes (dp across) and across them (dp inside). Per layout (the GPT of the lessons at
n_layer 2, n_embd 32, T 16, B 8, float64): --steps pairs of steps, one at B and one calibration
pass at one row per micro-batch, in alternating order, after one warm-up pair; per rank each
part's median over its steps, then the mean over the ranks; and the planner's parts
(pdist.plan.measured.plan_for on the profile of this machine, anchored on the calibration pass:
measured.anchor), the relative error per part where either side is at least --floor of the step
(else the absolute difference against --floor x step), the time blocked in collectives as one
part, then the bytes and ring steps pdist's groups counted beside the planner's. It counts the
parts within --tol twice: every part at least --floor of the step, and the rows the test holds
(measured_table.held_rows). The header says where it ran (load average), each layout how many
other processes were runnable beside it; the JSON goes to bench/results/plan_vs_measured.json.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from machine import header, record  # noqa: E402
from pdist.plan import measured_table  # noqa: E402
from pdist.testing import mpirun, reports  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORKER = os.path.join(ROOT, "tests", "workers", "plan_measured_worker.py")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=21,
                   help="timed step pairs (B, calibration) per layout, after one warm-up pair (default %(default)s)")
    p.add_argument("--tol", type=float, default=0.15, help="relative tolerance per part (default %(default)s)")
    p.add_argument("--floor", type=float, default=0.05,
                   help="parts under this fraction of the step are compared in absolute time (default %(default)s)")
    args = p.parse_args()
    if args.steps < 1 or not 0 < args.tol < 1 or not 0 < args.floor < 1:
        p.error(f"--steps must be >= 1 and --tol, --floor in (0, 1), got {args.steps}, {args.tol}, {args.floor}")
    print(header("plan_vs_measured"))
    results, hits, total, held, rows_held, cores = {}, 0, 0, 0, 0, len(os.sched_getaffinity(0))
    for n in (2, 4):
        got = reports(mpirun(n, WORKER, n, args.steps, timeout=600))[0]
        print(f"# {n} ranks: {got.pop('cpu_s'):.1f} CPU-s in the workers")
        for name, res in got.items():
            print(measured_table.render(name, res, args.tol, args.floor), end="\n\n")
            big = [r for r in measured_table.side_by_side(res, args.tol, args.floor)[2] if r[4] == "rel"]
            hits, total = hits + sum(r[5] for r in big), total + len(big)
            kept = measured_table.held_rows(res, n > cores, args.tol, args.floor)
            held, rows_held = held + sum(r[5] for r in kept), rows_held + len(kept)
            results[name] = res
    print(f"parts at least {args.floor:.0%} of the step: {hits} of {total} within {args.tol:.0%}")
    print(f"rows as the test holds them (measured_table.held_rows): {held} of {rows_held} within tolerance")
    print(f"# recorded {record('plan_vs_measured', {'layouts': results, 'steps': args.steps})}")


if __name__ == "__main__":
    main()
