"""Lesson 08 -- when it breaks: stragglers, slow links, hangs, layout-bound checkpoints.

    mpirun -n 4 python lessons/08_when_it_breaks.py
    mpirun -n 4 python lessons/08_when_it_breaks.py --trace trace.json    # open at ui.perfetto.dev
    mpirun -n 4 python lessons/08_when_it_breaks.py --acts 2              # one act (or --acts 1,3)

Four short acts, each with a measured table and a PASS line (docs/failures.md). Acts 1 and 2
are timings on shared cores: an act whose timings fail is measured once more (and says so)
before it counts as FAIL.

1. A straggler sets the pace. DDP on 4 ranks; rank 2 is made slow in compute
   (``--inject straggler:rank=2,slowdown=4``: after its compute it sleeps 3x as long; 4 ranks share
   2 cores here, and a sleeping rank lends its core to the others, so the fault is large). Every
   rank's step time rises to rank 2's: the others wait for it in the gradient all-reduce.
   ``pdist.faults.debug.straggler_report`` names the rank, by how much and the cause (a throttled
   device: slow every step); an uneven shard (slow only on the steps where it holds more
   tokens) is told apart; removing the fault restores the pace.
2. Communication swamps compute, on a simulated cluster of 2 nodes x 2 ranks whose
   inter-node link is slow (pdist/comm/topology.py: each collective is charged the
   alpha-beta time of the slowest link its group crosses). Tensor parallelism inside a node
   with data parallelism across, against the other way round; DDP against ZeRO-3 over the
   slow link. Measured step times beside the prediction: the step without the simulation
   plus the alpha-beta time of the bytes counted per link.
3. A hang turned into an error: a rank that exits early and a rank that skips a collective,
   each in a child job (so this lesson survives), each caught with the roll-call, timed.
4. A checkpoint tied to one layout: ZeRO-3's per-rank dump does not load into 2 ranks; the
   resharding checkpoint (pdist.checkpoint) does, equal to the 4-rank model.

Inside the emulated cluster (``python -m pdist.cluster --nodes 2 --ranks-per-node 2 -- python
lessons/08_when_it_breaks.py``: PDIST_NODE_LINK set, 2 nodes by hostname) act 2 runs on the
real link between the nodes instead (TCP over a veth pair, rate-limited with ``--link-gbps``):
tp across the nodes by renumbering the world, the link's alpha and beta measured by a
ping-pong, the kernel's byte counters beside pdist's; it says which link it used.

The simulated cluster is scaled to the lesson's tiny model: a 64-wide GPT computes a step in
milliseconds, so the inter-node link is 20 MB/s with 200 us latency (with 1000x the
parameters and compute: 20 GB/s; a latency that a tiny step feels as a real one feels 10 us). The ratio of communication to compute is what matters.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
import warnings

import numpy as np

from pdist import checkpoint, comm, data
from pdist.faults import debug, inject
from pdist.course import lesson
from pdist.engine.backend import synchronize
from pdist.comm import nodes, topology, watchdog
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, ZeRO, parallelize
from pdist.training import train

CLUSTER = "nodes={nodes},intra=300GB/s:2us,inter=20MB/s:200us"
CHILD_FAULTS = {"early exit": "exit:rank=1,step=3", "skipped collective": "skip-collective:rank=3,step=3"}


def parse():
    p = lesson.parser(__doc__, steps=8, dtype="float32", batch_size=16, no_inject=(
        "lesson 08 injects its own fault in each act (and clears it after); to inject one yourself, "
        "use lessons 02-07, e.g. mpirun -n 2 python lessons/02_data_parallel.py --inject nan:rank=1,step=3"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)     # act 3's child jobs
    p.add_argument("--acts", default="1,2,3,4", help="the acts to run, e.g. 2 or 1,3 (default all four)")
    args = lesson.validate(p, p.parse_args())
    try:
        args.acts = sorted({int(a) for a in args.acts.split(",")})
    except ValueError:
        args.acts = []
    if not args.acts or not set(args.acts) <= {1, 2, 3, 4}:
        p.error("--acts: give act numbers 1-4 separated by commas, e.g. --acts 2 or --acts 1,3")
    return p, args


def say(world, *a):
    if world.rank == 0:
        print(*a, flush=True)


def timed_run(model, batch, steps, start=0):
    """Train ``steps`` steps after one warm-up; (median step seconds over ranks' records,
    this rank's records). The detector's records are this rank's phases per step."""
    opt = lesson.make_adamw(model.parameters())
    train(model, opt, batch, 1, start=start)
    debug.clear()
    for g in watchdog.groups():
        g.reset_stats()
    t = []
    train(model, opt, batch, steps, start=start + 1, on_step=lambda s, l: synchronize() or t.append(time.perf_counter()))
    return float(np.median(np.diff(t))) if len(t) > 1 else 0.0


# ------------------------------------------------------------------ act 1
def act_straggler(world, cfg, batch, args):
    say(world, "\n== act 1: a straggler sets the pace (DDP, 4 ranks) ==")
    rows, reps = [], {}
    for name, spec in (("healthy", None), ("straggler", "straggler:rank=2,slowdown=4"),
                       ("uneven shard", "uneven-shard:rank=1,extra=1.0"), ("fault removed", None)):
        inject.set(spec)
        model = DataParallel(GPT(cfg, args.seed), world)
        step_s = timed_run(model, batch, args.steps + 4)
        rep = debug.straggler_report(model, last=args.steps + 4, skip=0)
        inject.clear()
        reps[name] = (step_s, rep)
        for r in rep.rows:
            rows.append([name, r["rank"], r["step"] * 1e3, r["compute"] * 1e3, r["wait"] * 1e3])
        say(world, f"  {name:13s}: {rep.text}")
    say(world, lesson.table(rows, ["run", "rank", "step ms", "compute ms", "wait ms"], floatfmt="{:.1f}"))
    base, slow, fixed = reps["healthy"][0], reps["straggler"][0], reps["fault removed"][0]
    s_rep, u_rep = reps["straggler"][1], reps["uneven shard"][1]
    steps_s = [r["step"] for r in s_rep.rows]
    paced = max(steps_s) < 1.25 * min(steps_s)      # every rank at the straggler's pace (a 3-5x fault)
    checks = {"straggler named": s_rep.rank == 2 and s_rep.cause == "throttled device",
              "uneven shard named": u_rep.rank == 1 and u_rep.cause == "uneven shard",
              "ranks paced together": paced, "the straggler slows the step": slow > 1.15 * base,
              "removing it restores the pace": fixed < slow / 1.15}
    ok = all(checks.values())
    say(world, f"step time (median over steps): healthy {base * 1e3:.1f} ms, with the straggler {slow * 1e3:.1f} ms "
               f"({slow / base:.2f}x: everyone runs at rank 2's pace), fault removed {fixed * 1e3:.1f} ms")
    say(world, f"{'PASS' if ok else 'FAIL'}: act 1 -- the detector names rank {s_rep.rank} ({s_rep.cause}, "
               f"{s_rep.slowdown:.2f}x) and rank {u_rep.rank} ({u_rep.cause}); removing the fault restores the pace"
               + ("" if ok else f" [failed: {', '.join(k for k, v in checks.items() if not v)}]"))
    return ok, {"name": "straggler", "step_s": {k: v[0] for k, v in reps.items()},
                "named": {k: [v[1].rank, v[1].cause] for k, v in reps.items()}}


# ------------------------------------------------------------------ act 2
def per_link(groups):
    """Bytes and messages per step this rank sent, by simulated link ('intra'/'inter')."""
    out = {}
    for g in groups:
        link = getattr(g, "_link", None)
        if link is None:
            continue
        b, m = out.get(link.name, (0, 0))
        out[link.name] = (b + g.bytes_sent(), m + sum(s["calls"] for s in g.stats.values()))
    return out


def in_the_box(world):
    """(True, why) inside the emulated cluster (pdist.cluster: PDIST_NODE_LINK set) on 2 nodes of 2
    ranks by hostname, numbered in blocks; else (False, why the simulation is used)."""
    link = os.environ.get("PDIST_NODE_LINK")
    if not link:
        return False, "not in the box (PDIST_NODE_LINK unset): the simulated link"
    if nodes.hosts() != [nodes.names()[0]] * 2 + [nodes.names()[-1]] * 2:
        return False, f"in the box, but the ranks are on {nodes.hosts()}, not 2 nodes x 2: the simulated link"
    return True, f"the real link between the box's nodes ({link}, the kernel's counters beside pdist's)"


def link_counter(name="tx"):
    """This node's link interface's bytes sent (or received) so far, the kernel's counter."""
    with open(f"/sys/class/net/{os.environ['PDIST_NODE_LINK']}/statistics/{name}_bytes") as f:
        return int(f.read())


def ping_pong(world, nbytes, rounds):
    """Seconds per one-way message of ``nbytes`` between rank 0 (node 1) and rank 2 (node 2): the
    link under MPI itself (mpi4py's Send/Recv, none of pdist's checks), the best of ``rounds``."""
    from mpi4py import MPI
    buf, c, best = np.zeros(max(1, nbytes // 8)), MPI.COMM_WORLD, float("inf")
    world.barrier()
    for _ in range(rounds if world.rank in (0, 2) else 0):
        t0 = time.perf_counter()
        if world.rank == 0:
            c.Send(buf, 2)
            c.Recv(buf, 2)
        else:
            c.Recv(buf, 0)
            c.Send(buf, 0)
        best = min(best, (time.perf_counter() - t0) / 2)
    return world.broadcast_object(best if world.rank == 0 else None)


def act_links_real(world, cfg, batch, args, why):
    """Act 2 on the box's real link: the same four layouts, placed on the two nodes by the rank
    order (tp across: the world renumbered 0, 2, 1, 3), timed; the prediction is each run's compute
    (the detector's) plus the alpha-beta time, on the link's measured alpha and beta, of the bytes
    pdist counted in the groups that cross nodes (every message of a collective, no overlap)."""
    say(world, f"\n== act 2: communication swamps compute (2 nodes x 2 ranks of the box; {why}) ==")
    alpha = ping_pong(world, 8, 50)
    beta = (1 << 22) / max(ping_pong(world, 1 << 22, 5) - alpha, 1e-9)
    swapped = world.split(0, [0, 2, 1, 3][world.rank], name="swapped")    # tp across the nodes
    layouts = [("tp in node, dp across", dict(dp=2, tp=2), world, 0),
               ("tp across, dp in node", dict(dp=2, tp=2), swapped, 0),
               ("DDP dp=4 (2 nodes)", dict(dp=4), world, 0), ("ZeRO-3 dp=4 (2 nodes)", dict(dp=4), world, 3)]
    rows, res, steps, crossed = [], {}, max(4, args.steps // 2), {}
    for name, shape, w, stage in layouts:
        measured, kernel = float("inf"), []
        for _ in range(2):       # the faster of two runs: load from other processes only adds time
            with warnings.catch_warnings():     # tp across the nodes on purpose: no warning
                warnings.simplefilter("ignore")
                mesh = comm.DeviceMesh(**shape, world=w)
            model = parallelize(GPT(cfg, args.seed), mesh, zero_stage=stage)
            k0 = link_counter()
            step_s = timed_run(model, batch, steps)
            kernel.append(link_counter() - k0)
            cross = [g for g in watchdog.groups() if len(nodes.spans(g.ranks)) > 1]   # before anything else is sent
            sent = sum(g.bytes_sent() for g in cross) / steps
            msgs = sum(st["calls"] * topology.ring_steps(op, 2 if op in ("send", "recv") else g.size)
                       for g in cross for op, st in g.stats.items()) / steps
            measured = min(measured, max(world.all_gather_object(step_s)))
        comp = max(r["compute"] for r in debug.straggler_report(model, last=steps, skip=0).rows)
        link_s = max(world.all_gather_object(msgs * alpha + sent / beta))
        sent, msgs = sum(world.all_gather_object(sent)), max(world.all_gather_object(msgs))
        kern = sum(world.all_gather_object(min(kernel) if world.rank in (0, 2) else 0)) / (steps + 1)
        res[name] = (measured, comp + link_s)
        crossed[name] = {"counted_bytes_per_step": sent, "kernel_bytes_per_step": kern}
        rows.append([name, sent / 1024, kern / 1024, msgs, comp * 1e3, link_s * 1e3, (comp + link_s) * 1e3,
                     measured * 1e3])
    say(world, f"the link, measured: alpha {alpha * 1e6:.0f} us, beta {beta / 1e6:.0f} MB/s (MPI ping-pong between "
               f"ranks 0 and 2, the best of the rounds)")
    say(world, lesson.table(rows, ["layout", "crossing groups KiB/step", "kernel KiB/step", "msgs/step", "compute ms",
                                   "a-b link ms", "predicted ms", "measured ms"], floatfmt="{:.1f}"))
    say(world, "(crossing groups: what pdist counted as sent, per step summed over ranks, in the groups that span "
               "both nodes; kernel: what both nodes' link interfaces sent per step, headers and pdist's own "
               "messages included, the warm-up step spread over the steps. A 2-rank group sends all its bytes "
               "across; at dp = 4 only the cut bound must cross, 1/(2(n-1)) of the group's bytes each way)")
    return res, {"link": "real", "interface": os.environ["PDIST_NODE_LINK"], "alpha_s": alpha, "beta_Bps": beta,
                 "crossing": crossed}


def act_links(world, cfg, batch, args):
    real, why = in_the_box(world)
    if real:
        res, info = act_links_real(world, cfg, batch, args, why)
        return links_verdict(world, res, dict(info, why=why))
    say(world, f"\n== act 2: communication swamps compute (2 simulated nodes x 2 ranks, inter-node 20 MB/s; {why}) ==")
    layouts = [("tp in node, dp across", dict(dp=2, tp=2), "0+1/2+3", 0),
               ("tp across, dp in node", dict(dp=2, tp=2), "0+2/1+3", 0),
               ("DDP dp=4 (2 nodes)", dict(dp=4), "2x2", 0),
               ("ZeRO-3 dp=4 (2 nodes)", dict(dp=4), "2x2", 3)]
    rows, res, plains = [], {}, {}
    steps = max(4, args.steps // 2)
    for name, shape, placed, stage in layouts:
        topology.set(None)
        key = (tuple(shape.items()), stage)    # the two tp layouts are one layout without the simulation
        if key not in plains:
            mesh = comm.DeviceMesh(**shape)
            plains[key] = timed_run(parallelize(GPT(cfg, args.seed), mesh, zero_stage=stage), batch, 2 * steps)
        plain = plains[key]
        measured = float("inf")
        for _ in range(2):       # the faster of two runs: load from other processes only adds time
            mesh = comm.DeviceMesh(**shape, topology=CLUSTER.format(nodes=placed))
            model = parallelize(GPT(cfg, args.seed), mesh, zero_stage=stage)
            measured = min(measured, max(world.all_gather_object(timed_run(model, batch, steps))))
        groups = watchdog.groups()
        link_s = sum(s for _, s in topology.predict(groups).values()) / steps
        pl = per_link(groups)
        topology.set(None)
        # the slowest rank's link time sets the pace: take the max over ranks
        link_s = max(world.all_gather_object(link_s))
        pred = plain + link_s
        res[name] = (measured, pred)
        rows.append([name, pl.get("intra", (0, 0))[0] / steps / 1024, pl.get("inter", (0, 0))[0] / steps / 1024,
                     pl.get("inter", (0, 0))[1] / steps, plain * 1e3, link_s * 1e3, pred * 1e3, measured * 1e3])
    say(world, lesson.table(rows, ["layout", "intra KiB/step", "inter KiB/step", "inter msgs/step",
                                   "no-link ms", "a-b link ms", "predicted ms", "measured ms"], floatfmt="{:.1f}"))
    return links_verdict(world, res, {"link": "simulated", "cluster": CLUSTER, "why": why})


def links_verdict(world, res, info):
    a, b = res["tp in node, dp across"], res["tp across, dp in node"]
    c, d = res["DDP dp=4 (2 nodes)"], res["ZeRO-3 dp=4 (2 nodes)"]
    ok = (a[0] < b[0]) == (a[1] < b[1]) and (c[0] < d[0]) == (c[1] < d[1]) and a[1] < b[1]
    say(world, "Megatron's rule: tensor parallelism all-reduces activations in every layer, forward and backward "
               "(many messages, bytes growing with batch x sequence x width); data parallelism all-reduces the "
               "gradients once per step. Put the chatty axis (tp) on the fast links inside a node, and the "
               "once-a-step axis (dp) across nodes. ZeRO-3 moves 1.5x DDP's bytes (3 psi vs 2 psi) in many more "
               "messages, so over a slow link it pays more. " + (
                   "Measured below predicted = overlap: DDP issues its all-reduce during backward, ZeRO-3 "
                   "prefetches the next unit." if info["link"] == "simulated" else
                   "Measured above predicted: the prediction counts the link alone; each collective also pays "
                   "pdist's fingerprint exchange and checks, and the ranks share 2 cores."))
    say(world, f"{'PASS' if ok else 'FAIL'}: act 2 -- measured step times order as the alpha-beta prediction: "
               f"tp in node {a[0] * 1e3:.0f} ms < tp across {b[0] * 1e3:.0f} ms; "
               f"DDP {c[0] * 1e3:.0f} ms vs ZeRO-3 {d[0] * 1e3:.0f} ms (predicted {c[1] * 1e3:.0f} vs {d[1] * 1e3:.0f})")
    say(world, f"(act 2 used {info['why']})")
    return ok, dict(info, name="links", layouts={k: {"measured_s": v[0], "predicted_s": v[1]} for k, v in res.items()})


# ------------------------------------------------------------------ act 3
def child(args):
    """A child job (act 3): DDP with one fault injected; it must fail, not hang."""
    world, tokens, tok = lesson.start(args)
    inject.set(CHILD_FAULTS[args.child])
    cfg = lesson.config_from_args(args, tok.vocab_size)
    model = DataParallel(GPT(cfg, args.seed), world)
    train(model, lesson.make_adamw(model.parameters()),
          lambda s: data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, s), 6)
    print(f"[child] rank {world.rank} finished all steps", flush=True)


def clean_env():
    """The environment of a child job launched from inside an MPI rank: without every
    launcher's variables (Hydra's, Open MPI's/PRRTE's/PMIx's, Intel's, Slurm's: a None value
    removes one; pdist.launcher.nested_env), so the child is a new job, not a part of this one."""
    from pdist.launcher import nested_env
    return dict(nested_env(), PDIST_TIMEOUT="20")


def explain(out):
    """One rank's error from a child job, wrapped to 100 columns: the error line, the lines that
    say who is where (roll-call or fingerprints), and for a dropped Work which rank skipped which
    collective and where the job caught it."""
    from pdist.testing import failures
    texts = [t for t in failures(out).values() if re.search(r"Collective\w+Error:", t)]
    if not texts:
        return "  " + out[-800:]
    lines = texts[0].splitlines()
    first = next(i for i, ln in enumerate(lines) if re.search(r"Collective\w+Error:", ln))
    error = re.sub(r"^.*?(Collective\w+Error:)", r"\1", lines[first])
    body = [ln for ln in lines[first + 1:] if ln.strip() and not ln.startswith("flight recorder:")]
    said = textwrap.wrap(error, 98, initial_indent="  ", subsequent_indent="      ")
    for ln in body[:6]:
        said += textwrap.wrap(ln.strip(), 100, initial_indent="    ", subsequent_indent="        ")
    m = re.search(r"CollectiveMismatchError: (\w+ #\d+) on group .*?: (rank \d+): async (\w+ #\d+) on group "
                  r"'([^']+)' was never waited on", error)
    if m:
        said.append(f"  => {m[2]} skipped a collective: it never waited on {m[3]} (its gradient sync),\n"
                    f"     so its gradients were never averaged; every rank is told at the next one, {m[1]}")
    return "\n".join(said)


def act_hangs(world, args):
    say(world, "\n== act 3: a hang turned into an error (child jobs of 4 ranks, PDIST_TIMEOUT=20 s) ==")
    from pdist.testing import launch
    result = None
    if world.rank == 0:
        result, rows = {}, []
        for name, spec in CHILD_FAULTS.items():
            run = launch(4, os.path.abspath(__file__), "--child", name, "--steps", "6", timeout=90, env=clean_env(),
                         wrap=False)
            t_end = time.time()
            stamps = [float(x) for x in re.findall(r"\[inject\] rank \d+ step \d+: .*? at t=([0-9.]+)", run.out)]
            errors = [ln.split("] ", 1)[-1] for ln in run.out.splitlines()
                      if re.search(r"(CollectiveMismatchError|CollectiveTimeoutError):", ln)]
            detect = t_end - stamps[0] if stamps else float("nan")
            caught = run.rc not in (0, None) and bool(errors) and "finished all steps" not in run.out
            result[name] = {"rc": run.rc, "detect_s": detect, "seconds": run.seconds, "caught": caught,
                            "error": errors[0] if errors else run.out[-400:]}
            rows.append([name, spec, run.rc, detect, run.seconds, "yes" if caught else "NO"])
            print(f"\n-- {name} ({spec}):\n" + explain(run.out), flush=True)
        print("\n" + lesson.table(rows, ["fault", "inject", "exit code", "detected after s", "job s", "caught"],
                          floatfmt="{:.2f}"), flush=True)
    result = world.broadcast_object(result)
    ok = all(v["caught"] and v["detect_s"] < 20 for v in result.values())
    say(world, f"{'PASS' if ok else 'FAIL'}: act 3 -- each fault ends its job with an error naming the rank, "
               f"none hangs (detected after " + ", ".join(f"{v['detect_s']:.2f} s" for v in result.values()) + ")")
    return ok, {"name": "hangs", "faults": result}


# ------------------------------------------------------------------ act 4
def act_checkpoint(world, cfg, batch, args):
    say(world, "\n== act 4: a checkpoint tied to one layout (ZeRO-3 on 4 ranks, loaded into 2) ==")
    z3 = ZeRO(GPT(cfg, args.seed), 3, world)
    opt = lesson.make_adamw(z3.parameters())
    train(z3, opt, batch, 2)
    full4 = z3.full_state_dict()
    root = world.broadcast_object(tempfile.mkdtemp(prefix="pdist-lesson08-") if world.rank == 0 else None)
    naive_dir, ckpt = os.path.join(root, "naive"), os.path.join(root, "step-000002")
    if world.rank == 0:
        os.makedirs(naive_dir)
    world.barrier()
    np.savez(os.path.join(naive_dir, f"rank-{world.rank}.npz"), **{u.name: u.shard.data for u in z3.units})
    checkpoint.save(z3, opt, ckpt, step=2)
    pair = world.split(0 if world.rank < 2 else 1, name="pair")
    naive_err, equal, load_s = None, None, 0.0
    if world.rank < 2:
        z2 = ZeRO(GPT(cfg, args.seed + 1), 3, pair)          # other weights: the load must overwrite them
        saved = np.load(os.path.join(naive_dir, f"rank-{pair.rank}.npz"))
        try:
            for u in z2.units:
                if saved[u.name].shape != u.shard.data.shape:
                    raise ValueError(f"{u.name}: the file holds {saved[u.name].shape[0]} elements (1/4 of the padded "
                                     f"flat unit) but a rank of 2 holds {u.shard.data.shape[0]} (1/2)")
                u.shard.data[...] = saved[u.name]
        except ValueError as e:
            naive_err = str(e)
        opt2 = lesson.make_adamw(z2.parameters())
        t0 = time.perf_counter()
        checkpoint.load(z2, opt2, ckpt)
        load_s = time.perf_counter() - t0
        full2 = z2.full_state_dict()
        equal = all(np.array_equal(full2[k], full4[k]) for k in full4)
    got = world.all_gather_object((naive_err, equal, load_s))
    world.barrier()
    if world.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    rows = [[r, "error" if e else "loaded?!", "equal" if q else "DIFFERENT", s * 1e3] for r, (e, q, s) in
            enumerate(got[:2])]
    say(world, f"naive per-rank dump into 2 ranks: ValueError: {got[0][0]}")
    say(world, lesson.table(rows, ["rank of 2", "naive dump", "pdist.checkpoint", "load ms"], floatfmt="{:.1f}"))
    ok = all(e is not None and q for e, q, _ in got[:2])
    say(world, f"{'PASS' if ok else 'FAIL'}: act 4 -- the naive dump fails under another world size; the resharding "
               f"checkpoint loads into 2 ranks, equal to the 4-rank model")
    return ok, {"name": "checkpoint", "naive_error": got[0][0], "equal": [q for _, q, _ in got[:2]]}


def main():
    parser, args = parse()
    if args.child:
        return child(args)
    world, tokens, tok = lesson.start(args)
    if world.size != 4:
        parser.error(f"this lesson places 4 ranks on 2 simulated nodes: run it with mpirun -n 4 (got {world.size})")
    if args.batch_size % 4:
        parser.error(f"--batch-size {args.batch_size} must divide by 4 ranks")
    cfg = lesson.config_from_args(args, tok.vocab_size)

    def batch(step):
        return data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)
    t0 = time.perf_counter()
    oks, runs = [], []
    for i, act in enumerate((lambda: act_straggler(world, cfg, batch, args),
                             lambda: act_links(world, cfg, batch, args),
                             lambda: act_hangs(world, args), lambda: act_checkpoint(world, cfg, batch, args))):
        if i + 1 not in args.acts:
            continue
        ok, run = act()
        if not ok and i < 2:       # acts 1 and 2 are timings on shared cores: measure once more
            say(world, f"(act {i + 1}: the timings above may be disturbed by other processes; measuring again)")
            ok, run = act()
        oks.append(ok)
        runs.append(run)
    say(world, f"\n(acts {', '.join(map(str, args.acts))}: {time.perf_counter() - t0:.1f} s)")
    lesson.finish("08_when_it_breaks", all(oks), runs, args, rank=world.rank, world_size=world.size,
                  detail="-- " + ", ".join(f"act {a} {'PASS' if o else 'FAIL'}" for a, o in zip(args.acts, oks)))


if __name__ == "__main__":
    sys.exit(main())
