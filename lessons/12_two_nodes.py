"""Lesson 12 -- two nodes: a real network link between two hosts, and hybrid sharding across it.

    sudo python lessons/12_two_nodes.py          # makes 2 emulated nodes x 2 ranks (pdist.cluster):
                                                 # the link at 1 Gbit, then unlimited
    python -m pdist.cluster --nodes 2 --ranks-per-node 2 --link-gbps 1 -- python lessons/12_two_nodes.py
    mpirun -n 4 python lessons/12_two_nodes.py   # no box: lesson 08's simulated link, said in the first line

The box (docs/cluster.md, "Two nodes in one box") gives each node its own network namespace,
hostname and /dev/shm, so MPI talks TCP between the nodes over a veth pair, as between two
hosts on Ethernet, and shared memory inside a node. ``tc``'s token bucket limits the link.
pdist reads the nodes from the hostnames, as on a real cluster.

On that link, five layouts of one GPT train the same global batches:

  tp in node, dp across     Megatron's rule: tensor parallelism's per-layer all-reduces stay on
                            the fast link; data parallelism crosses once a step
  tp across, dp in node     the other way round
  DDP                       dp 4 over both nodes: one all-reduce of the gradients, 2(N-1)/N·bΨ
  ZeRO-3                    dp 4 over both nodes: all-gather twice + reduce-scatter, 3(N-1)/N·bΨ,
                            every byte on a ring that crosses the link
  HSDP                      ZeRO-3 inside each node (dp_shard 2), replicas across (dp_replicate 2):
                            only the gradient shard crosses, all-reduced between the 2 replicas,
                            2(R-1)/R·bΨ/S per rank, bΨ per node (Zhang et al. 2022, MiCS;
                            FSDP's hybrid sharding)

For each: the bytes each node sent per step (MiB), read from the kernel's interface counter
(/sys/class/net/<link>/statistics/tx_bytes), beside two formulas from pdist's own per-group
counts (pdist/comm/link_bytes.py): "ring", what a flat ring in group order puts on the link, and
"least", what any algorithm must send (a node reduces or relays inside itself first: an all-reduce
across 2 nodes sends S per node). A 2-rank group sends the same by any algorithm, so tp's and
HSDP's replicas are exact; MPICH's node-aware all-reduce reaches "least" for DDP; its recursive
doubling sends more than the ring for ZeRO-3's gathers. Then the step time beside the planner's
prediction (pdist.plan.measured: every group's alpha and beta measured on its own link, compute
from the GEMM rate, so on shared cores its compute is low; the differences between layouts are
its claim), and the alpha-beta of the link between the nodes, measured by a 2-rank all-reduce.

PASS means: every layout's losses equal one process's on the same batches (float32: rtol 1e-4);
on a real link every node sent at least the "least" bytes and HSDP's are within 10% of them;
at a limited link tp in a node beats tp across, HSDP beats ZeRO-3, and (on the real link) by
the planner's margin within 25%. A timing check that fails sends every layout round once more
(the faster run counts, and the lesson says so); one disturbed by load says "inconclusive".
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from pdist import comm, data
from pdist.comm import topology
from pdist.comm.link_bytes import crossing
from pdist.course import lesson
from pdist.engine.backend import synchronize
from pdist.launcher import in_a_job, nested_env
from pdist.models.gpt import GPT
from pdist.parallel import parallelize
from pdist.plan.measured import group_link, plan_for
from pdist.training import train

SIMULATED = "nodes=2x2,intra=5GB/s:20us,inter={gbps}Gbps:{lat}us"
TIMING = ("tp in a node beats tp across", "HSDP beats ZeRO-3", "HSDP's margin within 25% of the planner's")
LAYOUTS = (("tp in node, dp across", dict(dp=2, tp=2), False, 0),
           ("tp across, dp in node", dict(dp=2, tp=2), True, 0),
           ("DDP dp 4", dict(dp=4), False, 0),
           ("ZeRO-3 dp 4", dict(dp=4), False, 3),
           ("HSDP 2 x 2, ZeRO-3", dict(dp_replicate=2, dp_shard=2), False, 3))


def parse():
    p = lesson.parser(__doc__, steps=6, dtype="float32", batch_size=16, no_inject=(
        "lesson 12 measures clean runs on a real link; to inject a fault yourself, use lessons 02-07, "
        "e.g. mpirun -n 2 python lessons/02_data_parallel.py --inject nan:rank=1,step=3"),
        n_layer=4, n_embd=128, n_head=4, block_size=64)
    p.add_argument("--link-gbps", default="1,0",
                   help="the link limits to run, comma-separated, 0 = unlimited (default %(default)s; "
                        "only when this lesson makes the box itself)")
    p.add_argument("--mpi", choices=["mpich", "openmpi"], default="mpich", help="the MPI the box runs")
    args = lesson.validate(p, p.parse_args())
    try:
        args.links = [float(g) for g in args.link_gbps.split(",")]
    except ValueError:
        p.error(f"--link-gbps {args.link_gbps!r}: comma-separated numbers of Gbit/s (0 = unlimited)")
    if not args.links or any(g < 0 for g in args.links):
        p.error(f"--link-gbps {args.link_gbps!r}: give one or more limits >= 0 (0 = unlimited)")
    if args.batch_size % 4:
        p.error(f"--batch-size {args.batch_size} must divide over 4 data-parallel ranks")
    return args


# ------------------------------------------------------------------ the nodes and their link
def node_ids(world):
    """Each rank's node, from the hostnames (as on a cluster): ranks on one host are one node."""
    hosts = world.all_gather_object(os.uname().nodename)
    order = list(dict.fromkeys(hosts))
    return [order.index(h) for h in hosts]


def link_counter():
    """(tx, rx) bytes of this node's link, from the kernel (None outside the box)."""
    dev = os.environ.get("PDIST_NODE_LINK")
    if not dev:
        return None
    base = f"/sys/class/net/{dev}/statistics/"
    return tuple(int(open(base + k).read()) for k in ("tx_bytes", "rx_bytes"))


def across(nodes):
    """The world's ranks reordered so that neighbours (a tp pair) sit on different nodes."""
    by_node = [[r for r, n in enumerate(nodes) if n == k] for k in sorted(set(nodes))]
    return [r for pair in zip(*by_node) for r in pair]


def link_alpha_beta(world, nodes):
    """The measured link between node 0 and node 1 (an all-reduce on a 2-rank group across it)."""
    mine = nodes[world.rank]
    local = [r for r in range(world.size) if nodes[r] == mine].index(world.rank)
    pair = world.split(local, world.rank, "link")
    lk = group_link(pair, (8, 4 << 20))    # with a simulated link: the transport's plus the charged one
    return lk.alpha, lk.beta


# ------------------------------------------------------------------ one layout
def run_layout(world, nodes, cfg, batch, args, ref_losses, shape, permute, stage):
    w = world.split(0, across(nodes).index(world.rank), "permuted") if permute else world
    mesh = comm.DeviceMesh(world=w, **shape)
    model = parallelize(GPT(cfg, args.seed), mesh, zero_stage=stage)
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, 2)                 # warm-up: connections made, buffers pooled
    from pdist.comm import watchdog
    groups = [g for g in watchdog.groups() if g.size > 1]
    for g in groups:
        g.reset_stats()
    world.barrier()
    c0, t = link_counter(), []
    world.barrier()                    # no rank sends the next step's bytes before its node's counter is read
    losses += train(model, opt, batch, args.steps, start=2,
                    on_step=lambda s, l: synchronize() or t.append(time.perf_counter()))
    world.barrier()
    c1 = link_counter()
    step_s = max(world.all_gather_object(float(np.median(np.diff(t)))))
    steps = args.steps
    mine = crossing(groups, nodes.__getitem__, world.rank, steps)      # this rank's share, both formulas
    sent = None if c0 is None else (c1[0] - c0[0]) / steps             # the node's, read by each of its ranks
    per_rank = world.all_gather_object((mine, sent))
    plan = plan_for(model, (args.batch_size, cfg.block_size))
    ok = bool(np.allclose(losses, ref_losses, rtol=1e-4, atol=0))
    ids = sorted(set(nodes))
    return dict(step_s=step_s, predicted_s=plan["time_per_step"]["total"], equal=ok,
                **{f: [sum(c[f] for (c, _), n in zip(per_rank, nodes) if n == k) for k in ids] for f in ("ring", "least")},
                kernel=[next((s for (_, s), n in zip(per_rank, nodes) if n == k), None) for k in ids])


def inside(args):
    """The 4-rank program: on the box's real link, or on lesson 08's simulated one."""
    world, tokens, tok = lesson.start(args)
    real = bool(os.environ.get("PDIST_NODE_LINK"))
    if not real:
        topology.set(SIMULATED.format(gbps=args.links[0] or 10, lat=50))
    nodes = node_ids(world) if real else [r // 2 for r in range(world.size)]
    if world.size != 4 or sorted(nodes) != [0, 0, 1, 1]:
        raise SystemExit(f"lesson 12 runs 4 ranks on 2 nodes of 2 (got {world.size} ranks on nodes {nodes}): "
                         f"sudo python lessons/12_two_nodes.py, or mpirun -n 4 python lessons/12_two_nodes.py")
    hosts = sorted(set(world.all_gather_object(os.uname().nodename)))
    what = (f"two emulated nodes ({', '.join(hosts)}), real TCP over their link {os.environ['PDIST_NODE_LINK']}"
            if real else f"no box here: lesson 08's simulated link instead ({SIMULATED.format(gbps=args.links[0] or 10, lat=50)})")
    if world.rank == 0:
        print(f"lesson 12: {what}", flush=True)
    cfg = lesson.config_from_args(args, -(-tok.vocab_size // 2) * 2)
    batch = data.batch_fn(tokens, args.batch_size, cfg.block_size, args.seed)
    ref = lesson.train_reference(cfg, args.seed, args.steps + 2, args.batch_size, tokens)[0] if world.rank == 0 else None
    ref = world.broadcast_object(ref, src=0)
    alpha, beta = link_alpha_beta(world, nodes)
    def measure():
        return {name: run_layout(world, nodes, cfg, batch, args, ref, shape, perm, stage)
                for name, shape, perm, stage in LAYOUTS}
    out = dict(real=real, what=what, params=cfg.num_params(), alpha_s=alpha, beta_Bps=beta, layouts=measure(),
               load=os.getloadavg()[0], cores=os.cpu_count(), measured_twice=False)
    limited = not real or bool(args.links[0])
    # rank 0's verdicts on every rank (its load and its planner's calibration): one decision, no hang
    out["checks"] = world.broadcast_object(verdicts(out, limited), src=0)
    if any(v is False for k, v in out["checks"].items() if k in TIMING):   # as lesson 08: once more, the faster
        if world.rank == 0:
            print(render(out) + "\na timing check failed: every layout measured once more, the faster run counts",
                  flush=True)
        for name, r in measure().items():
            out["layouts"][name]["step_s"] = min(out["layouts"][name]["step_s"], r["step_s"])
        out.update(measured_twice=True, load=max(out["load"], os.getloadavg()[0]))
        out["checks"] = world.broadcast_object(verdicts(out, limited), src=0)
    if world.rank == 0:
        print(render(out), flush=True)
    return world, out


# ------------------------------------------------------------------ what it shows
def render(out):
    rows = []
    for name, r in out["layouts"].items():
        kern = [k for k in r["kernel"] if k is not None]
        mean = lambda v: sum(v) / len(v) / 2 ** 20                    # noqa: E731  MiB per node per step
        rows.append([name, mean(r["ring"]), mean(r["least"]), mean(kern) if kern else "-",
                     (sum(kern) / sum(r["least"])) if kern and sum(r["least"]) else "-",
                     r["step_s"] * 1e3, r["predicted_s"] * 1e3, "yes" if r["equal"] else "NO"])
    head = (f"link between the nodes, measured: alpha {out['alpha_s'] * 1e6:.0f} us, beta {out['beta_Bps'] / 1e6:.0f} MB/s"
            f" (load {out['load']:.1f} on {out['cores']} cores)")
    return head + "\n" + lesson.table(rows, ["layout", "ring MiB", "least MiB", "kernel MiB", "kernel/least",
                                             "step ms", "planner ms", "= 1 process"], floatfmt="{:.2f}")


def verdicts(out, limited):
    """{check: True/False/None (inconclusive)} of one run (module doc)."""
    L = out["layouts"]
    checks = {"every layout equals one process": all(r["equal"] for r in L.values())}
    if out["real"]:
        checks["every node sent at least the least formula"] = all(
            r["kernel"][k] >= 0.99 * r["least"][k] for r in L.values() for k in range(len(r["least"])))
        h = L["HSDP 2 x 2, ZeRO-3"]
        checks["HSDP's kernel bytes within 10% of its formula"] = all(
            abs(k / f - 1) <= 0.10 for k, f in zip(h["kernel"], h["least"]))
    if limited:
        busy = out["load"] > out["cores"] + 2          # other work on the cores: timings say nothing
        tp_in, tp_x = L["tp in node, dp across"]["step_s"], L["tp across, dp in node"]["step_s"]
        z3, hs = L["ZeRO-3 dp 4"], L["HSDP 2 x 2, ZeRO-3"]
        m, p = z3["step_s"] - hs["step_s"], z3["predicted_s"] - hs["predicted_s"]
        for name, ok in ((TIMING[0], tp_in < tp_x), (TIMING[1], hs["step_s"] < z3["step_s"]),
                         *[(TIMING[2], p > 0 and abs(m - p) <= 0.25 * p)] * out["real"]):
            checks[name] = None if busy and not ok else ok
    return checks


def box_runs(args):
    """This lesson run inside pdist.cluster's two nodes, once per link limit: [(gbps, out)]."""
    from pdist.cluster import Box
    runs = []
    argv = ["python", os.path.abspath(__file__), "--steps", str(args.steps), "--seed", str(args.seed),
            "--batch-size", str(args.batch_size), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
            "--n-head", str(args.n_head), "--block-size", str(args.block_size)]
    print(f"lesson 12: two emulated nodes x 2 ranks (pdist.cluster, {args.mpi}), real TCP between them; the link at "
          + ", then ".join(f"{g:g} Gbit/s" if g else "unlimited" for g in args.links), flush=True)
    tmp = tempfile.mkdtemp(prefix="pdist-lesson12-")
    try:
        with Box(nodes=2, ranks_per_node=2, link_gbps=args.links[0] or None, mpi=args.mpi) as box:
            for i, g in enumerate(args.links):
                box.set_link(gbps=g or None)
                path = os.path.join(tmp, f"run{i}.json")
                r = box.run(argv + ["--json", path, "--link-gbps", str(g)], timeout=600)
                print(r.stdout, end="", flush=True)
                if not os.path.exists(path):     # a FAIL still writes its summary; a crash does not
                    print(r.stderr, file=sys.stderr, flush=True)
                    raise SystemExit(f"lesson 12: the run at {g or 'unlimited'} Gbit/s failed ({r.returncode})")
                with open(path) as f:
                    out = json.load(f)["runs"][0]
                out["link_bytes"] = r.link
                runs.append((g, out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return runs


def simulated_runs(args, why):
    """No box here: the same program under mpiexec -n 4 on lesson 08's simulated link."""
    print(f"lesson 12: no box here ({why}); lesson 08's simulated link instead", flush=True)
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    drop = nested_env()
    rc = subprocess.call([mpiexec, "-n", "4", sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                         env={k: v for k, v in os.environ.items() if k not in drop})
    raise SystemExit(rc)


def main():
    args = parse()
    if os.environ.get("PDIST_NODE_LINK") or in_a_job():
        world, out = inside(args)
        checks = out["checks"]
        say_checks(world.rank, checks)
        return lesson.finish("12_two_nodes", all(v is not False for v in checks.values()), [out], args,
                             rank=world.rank, world_size=world.size)
    from pdist.cluster import available
    ok, why = available()
    if not ok:
        simulated_runs(args, why)
    runs = box_runs(args)
    checks = {}
    for g, out in runs:
        for k, v in out["checks"].items():
            checks[f"{k} ({g or 'unlimited'} Gbit/s)"] = v
    say_checks(0, checks)
    return lesson.finish("12_two_nodes", all(v is not False for v in checks.values()), [o for _, o in runs], args)


def say_checks(rank, checks):
    if rank == 0:
        for k, v in checks.items():
            print(f"  {'ok' if v else 'inconclusive' if v is None else 'FAILED'}: {k}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
