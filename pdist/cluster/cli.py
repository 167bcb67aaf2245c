"""``python -m pdist.cluster``: run a command across N emulated nodes of this machine.

    python -m pdist.cluster --nodes 2 --ranks-per-node 2 -- python lessons/03_zero.py --steps 3
    python -m pdist.cluster --nodes 2 --ranks-per-node 2 --link-gbps 1 --mpi openmpi -- python lessons/06_mesh.py
    python -m pdist.cluster --cleanup          # remove what dead runs left (their state records prove it)

The command's output streams as it runs; then one line per node gives the bytes its link sent
and received (the kernel's interface counters), and the exit status is the command's. Where no
box can be made (not root, no namespaces) it prints one line saying why and exits 2.
"""
import argparse
import signal
import sys

from pdist.cluster import box as boxes
from pdist.cluster import state
from pdist.cluster.netns import BoxError


def _pos(kind):
    def f(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a{'n integer' if kind is int else ' number'}")
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{s!r} must be > 0")
        return v
    return f


def parser():
    p = argparse.ArgumentParser(prog="python -m pdist.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=_pos(int), default=2, help="emulated nodes (>= 2; > 2: joined by a bridge)")
    p.add_argument("--ranks-per-node", type=_pos(int), default=2, help="MPI ranks on each node")
    p.add_argument("--link-gbps", type=_pos(float), default=None, help="limit each link to G Gbit/s each way (tbf)")
    p.add_argument("--link-latency-ms", type=_pos(float), default=None,
                   help="tbf's queue bound in ms (needs --link-gbps; default 50)")
    p.add_argument("--mpi", default="mpich", choices=["mpich", "openmpi"], help="MPICH (.venv) or Open MPI (.venv-ompi)")
    p.add_argument("--timeout", type=_pos(float), default=None, help="seconds before the run is killed")
    p.add_argument("--cleanup", action="store_true", help="only remove what dead runs left, then exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python lessons/03_zero.py")
    return p


def fmt(n):
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def main(argv=None):
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    ok, why = boxes.available()
    if not ok:
        print(f"pdist.cluster: no box here: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        for run_id, gone in state.reap().items():
            print(f"pdist.cluster: removed dead run {run_id}: {', '.join(gone) or 'no namespace left'}")
        return 0
    if not cmd:
        p.error("give the command after --, e.g. -- python lessons/03_zero.py")
    if args.nodes < 2:
        p.error(f"--nodes {args.nodes}: a box has at least 2 nodes")
    if args.link_latency_ms is not None and args.link_gbps is None:
        p.error("--link-latency-ms needs --link-gbps (it is the queue bound of tbf's rate limit)")
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))   # SIGTERM unwinds: the box comes down
    try:
        with boxes.Box(args.nodes, args.ranks_per_node, args.link_gbps, args.link_latency_ms, args.mpi) as box:
            print(f"[box {box.id}] {args.nodes} nodes x {args.ranks_per_node} ranks ({args.mpi}), link "
                  f"{box.plan['link']}" + (f" limited to {args.link_gbps:g} Gbit/s" if args.link_gbps else
                                           " unlimited"), file=sys.stderr, flush=True)
            r = box.run(cmd, timeout=args.timeout, capture=False)
    except BoxError as e:
        print(f"pdist.cluster: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[box] interrupted: the command was stopped and the box taken down", file=sys.stderr)
        return 130
    for node, c in r.link.items():
        print(f"[box] {node}: its link sent {fmt(c['tx'])} ({c['tx']} B), received {fmt(c['rx'])} ({c['rx']} B)")
    if r.timed_out:
        print(f"[box] timed out after {args.timeout:g} s", file=sys.stderr)
        return 124
    return r.returncode if r.returncode >= 0 else 128 - r.returncode
