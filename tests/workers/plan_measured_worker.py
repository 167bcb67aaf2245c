"""The planner beside the measured waterfall (tests/test_plan_measured.py, bench/plan_vs_measured.py):
every lesson layout of one world size in one launch.

    mpirun -n 2 python tests/workers/plan_measured_worker.py 2 [STEPS]   # dp2, zero-1..3, tp2, pp2 1f1b m4
    mpirun -n 4 python tests/workers/plan_measured_worker.py 4 [STEPS]   # dp2 x tp2; on 2 simulated nodes
                                                                         # with tp inside vs across them

Per layout: STEPS pairs of steps (default 5) after one warm-up pair, each timed by the Waterfall
and by an independent clock: one at the compared batch B, one calibration pass of the same
strategy at one row per micro-batch, in alternating order (the same load on both); the stats
(bytes, ring steps, the simulated link's charge) of the B steps only. Per rank each part's
median over its steps (pdist.plan.measured.part_medians) on both; then plan_for at both batches
(tp's link calibrated at its two activation sizes) and the plan at B anchored on the calibration
pass (measured.anchor: the mean over ranks of its medians). Rank 0 prints one ``report``:
{layout: {"ranks": [per rank: {"parts", "step_s", "tiny", "tiny_step_s", "ratios", "counted",
"planned", "raw"}], "plan": the anchored parts, "model"/"model_tiny": the planner's own at B and
at the calibration batch, "tiny": the calibration's measured parts, "tiny_rows", "calibration",
"op_s", "others_runnable": the median count of other runnable tasks beside the job's ranks,
sampled before each step}, "cpu_s"}; "counted"/"planned": per group the bytes and ring steps per
step that pdist's groups counted / the planner counts, and on a simulated link the seconds the
transport charged / the planner's count on that link alone ("charged_s"). An optional third
argument, indices into the layouts (``0,2``), runs only those.
"""
import os
import sys
import time

import numpy as np

from pdist import comm, data
from pdist.comm import topology
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.measure import waterfall
from pdist.models.gpt import GPT
from pdist.parallel import parallelize
from pdist.plan import measured
from pdist.testing import report

B, T = 8, 16
# two simulated nodes of two ranks; the inter-node link slow enough to show at this size
LINKS = "intra=2GB/s:20us,inter=50MB/s:1ms"
LAYOUTS = {2: {"dp2": ({"dp": 2}, {}), "zero-1": ({"dp": 2}, {"zero_stage": 1}),
               "zero-2": ({"dp": 2}, {"zero_stage": 2}), "zero-3": ({"dp": 2}, {"zero_stage": 3}),
               "tp2": ({"tp": 2}, {}), "pp2 1f1b m4": ({"pp": 2}, {"microbatches": 4})},
           4: {"dp2xtp2": ({"dp": 2, "tp": 2}, {}),
               "2 nodes, tp inside": ({"dp": 2, "tp": 2, "topology": "nodes=0+1/2+3," + LINKS}, {}),
               "2 nodes, tp across": ({"dp": 2, "tp": 2, "topology": "nodes=0+2/1+3," + LINKS}, {})}}


def _step(model, opt, wf, tokens, rows, seed, s):
    """One step of ``rows`` rows, timed by the Waterfall and by an independent clock."""
    wf.start()
    t0 = time.perf_counter()
    x, y = model.local_batch(*data.get_batch(tokens, rows, T, seed, s))
    model.forward_backward(x, y)
    opt.step()
    opt.zero_grad()
    t = time.perf_counter() - t0
    parts = wf.stop()
    return {"parts": parts, "step_s": wf.records[-1]["step_s"], "ratio": sum(parts.values()) / t}


def _others_runnable(pids):
    """Tasks running or runnable on the machine now (/proc/loadavg's 4th field) that are not one of
    the job's ranks ``pids`` in state R (/proc/<pid>/stat); None where /proc is absent."""
    try:
        with open("/proc/loadavg") as f:
            n = int(f.read().split()[3].split("/")[0])
        ours = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                ours += f.read().rsplit(")", 1)[1].split()[0] == "R"
        return max(0, n - ours)
    except (OSError, ValueError, IndexError):
        return None


def _add(acc, groups):
    """Add each group's stats (and the simulated link's charge) of the step just run into ``acc``."""
    for g, pg in groups.items():
        for op, v in pg.stats.items():
            a = acc[g].setdefault(op, {"calls": 0, "bytes": 0})
            a["calls"], a["bytes"] = a["calls"] + v["calls"], a["bytes"] + v["bytes"]
        acc[g]["_link_s"] = acc[g].get("_link_s", 0.0) + getattr(pg, "_link_s", 0.0)


def one_layout(world, tokens, vocab, axes, kw, steps):
    cfg = lesson.gpt_config(vocab, n_layer=2, n_head=2, n_embd=32, block_size=T)
    model = parallelize(GPT(cfg, 0), comm.DeviceMesh(**axes), **kw)
    opt = lesson.make_adamw(model.parameters())
    wf = waterfall.Waterfall(model)
    _, lay, groups = measured.layout_of(model, (B, T))
    tiny = lay.dp * lay.m                   # the calibration pass: one row per micro-batch
    if tiny >= B:
        sys.exit(f"plan_measured_worker: the calibration batch dp*m = {tiny} must be under B = {B} (axes {axes})")
    runs, acc, busy = {B: [], tiny: []}, {g: {} for g in groups}, []
    pids = world.all_gather_object(os.getpid())
    for s in range(steps + 1):              # the first pair is a warm-up; the order alternates
        for rows in ((B, tiny) if s % 2 else (tiny, B)):
            for g in groups.values():
                g.reset_stats()
                g._link_s = 0.0             # the simulated link's charge (pdist/comm/topology.py)
            n = _others_runnable(pids)
            if n is not None:           # other processes that want a core beside the job's ranks
                busy.append(n)
            r = _step(model, opt, wf, tokens, rows, 1 + (rows == tiny), s)
            if s:
                runs[rows].append(r)
                if rows == B:
                    _add(acc, groups)
    wf.close()
    count = measured.counted(groups, steps, {g: {k: v for k, v in a.items() if k != "_link_s"} for g, a in acc.items()})
    for g, pg in groups.items():
        count[g]["charged_s"] = acc[g].get("_link_s", 0.0) / steps if pg._link is not None else None
    item = np.dtype(cfg.dtype).itemsize                       # the activations' (float32: the lessons' GPT)
    act = lambda rows: rows * T * cfg.n_embd * item          # noqa: E731  (tp's activation all-reduce, bytes)
    sizes = {"tp": (act(1), act(lay.micro_batch))}           # the messages tp sends at the two batches
    plan, plan_tiny = (measured.plan_for(model, (b, T), world, sizes) for b in (B, tiny))
    pp_rank = groups["pp"].rank if "pp" in groups else 0
    planned = measured.planned_counts(plan, pp_rank)
    for g, pg in groups.items():      # the planner's count on the simulated link alone: what it charges
        if pg._link is not None and g in planned:
            lk = pg._link
            planned[g]["charged_s"] = lk.scale * (planned[g]["steps"] * lk.alpha + planned[g]["bytes"] / lk.bw)
    med = lambda rs: (measured.part_medians([r["parts"] for r in rs]), float(np.median([r["step_s"] for r in rs])))  # noqa: E731
    (parts, step), (tparts, tstep) = med(runs[B]), med(runs[tiny])
    mine = dict(parts=parts, step_s=step, tiny=tparts, tiny_step_s=tstep, counted=count, planned=planned,
                ratios=[r["ratio"] for r in runs[B] + runs[tiny]],
                raw=[[r["parts"] for r in runs[B]], [r["parts"] for r in runs[tiny]]])
    topology.set(None)
    ranks = world.all_gather_object(mine)
    names = list(dict.fromkeys(k for r in ranks for k in r["tiny"]))
    tiny_mean = {k: sum(r["tiny"].get(k, 0.0) for r in ranks) / len(ranks) for k in names}
    return {"ranks": ranks, "plan": measured.anchor(plan["measured_parts"], plan_tiny["measured_parts"], tiny_mean),
            "model": plan["measured_parts"], "model_tiny": plan_tiny["measured_parts"], "tiny": tiny_mean,
            "tiny_rows": tiny, "calibration": plan["calibration"], "op_s": plan["op_s"],
            "others_runnable": float(np.median(busy)) if busy else None}


def main(n, steps, only=None):
    set_default_dtype("float64")
    world = comm.init(timeout=60)
    if world.size != n:
        sys.exit(f"plan_measured_worker: launched on {world.size} ranks, asked for {n}")
    tokens, tok = data.char_dataset()
    out = {name: one_layout(world, tokens, tok.vocab_size, dict(axes), dict(kw), steps)
           for i, (name, (axes, kw)) in enumerate(LAYOUTS[n].items()) if only is None or i in only}
    cpu = world.gather_object(time.process_time())      # the CPU seconds this launch costs (the suite's budget)
    if world.rank == 0:
        report(**out, cpu_s=sum(cpu))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5,
         [int(i) for i in sys.argv[3].split(",")] if len(sys.argv) > 3 else None)
