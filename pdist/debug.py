"""``python -m pdist.debug``: debugging tools on the command line.

    python -m pdist.debug diverge RUN_A RUN_B [--rtol X] [--json]

``diverge``: where two fingerprinted runs (pdist.measure.fingerprint.record) part: the first
step, op, tensor and rank, and by how much (pdist/faults/diverge.py; docs/divergence.md).
Exit status 0: no divergence, 1: the runs part, 2: a usage error or a bad run directory.
"""
import argparse
import json
import sys


def _diverge(args):
    from pdist.faults.diverge import RunDirError, diverge
    try:
        d = diverge(args.run_a, args.run_b, rtol=args.rtol)
    except (RunDirError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: v for k, v in vars(d).items()}, default=str))
    else:
        print(d)
        if d.found:
            print(f"  A: n={d.a[0]} norm={d.a[1] ** 0.5:.17g} max={d.a[2]:.17g} sum={d.a[3]:.17g}")
            print(f"  B: n={d.b[0]} norm={d.b[1] ** 0.5:.17g} max={d.b[2]:.17g} sum={d.b[3]:.17g}")
    return 1 if d.found else 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pdist.debug", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("diverge", help="the first step/op/tensor/rank where two fingerprinted runs part")
    d.add_argument("run_a")
    d.add_argument("run_b")
    d.add_argument("--rtol", type=float, default=None,
                   help="relative threshold; 0 = identical bits (default: exact in deterministic mode, "
                        "else 1e-9 float64, 1e-5 float32, 1e-2 bf16/fp16)")
    d.add_argument("--json", action="store_true", help="print the Divergence as one JSON object")
    args = p.parse_args(argv)
    return _diverge(args)


if __name__ == "__main__":
    sys.exit(main())
