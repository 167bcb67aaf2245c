"""The planner on this machine, from measured facts, beside pdist's measured waterfall.

    plan = plan_for(model, (B, T))           # collective over the model's groups (calibration)
    rows = compare(wf_parts, step_s, plan)   # per part: measured, planned, error, verdict

A "this machine" profile (``this_machine``) is built from what is measured here, never from
the step it is compared with:

    peak (fp32, fp64)  pdist.measure.flops.gemm_rate: a 256^3 GEMM, the best of the ranks
                       (the same rate the waterfall's ideal compute divides by)
    efficiency         1.0 flat: every GEMM at that rate (the planner's roofline is for
                       library GEMMs on a device; the host's per-op Python cost is not in it)
    mem_bw             one large array copy, bytes read + written per second (the roofline's
                       slope for the elementwise work)
    links, per group   an all-reduce calibration on that very group at two sizes (8 B and 1 MiB,
                       or the layout's own: tp's activations at both batches), the median of 41
                       calls of each, sizes alternating: beta = ring bytes / (t(big) - t(small)),
                       alpha = the rest of t(small) / ring steps, cached per group; with a
                       simulated topology (PDIST_TOPOLOGY, pdist/comm/topology.py) the group's
                       charged link is added: alpha + alpha_topo, 1/beta + 1/beta_topo
    op_s               the host's seconds per pdist op (one Function forward and its backward):
                       a forward_backward of a 1-layer width-8 GPT (B 2, T 8), best of 5, over
                       the Function applications it made (host_op_cost); the planner charges
                       Arch.host_ops per micro-batch at it (pdist.plan.timing)
    step_s             AdamW's step + zero_grad on that model, per parameter tensor, best of 5
                       (host_step_cost); the planner's overhead is the tensors a rank steps
                       (Arch.host_tensors, or ZeRO's units) at it; nothing else of the Python
                       between the passes is modelled

``plan_for`` reads the layout off the running strategy's chain (DataParallel, ZeRO-k,
TensorParallel (SP), PipelineParallel (schedule, m)) and the model's config, and plans it
with pdist.plan.model.plan_config on that profile, each group on its own calibrated link.
``anchor`` sets the plan at the compared batch on a calibration pass of the same strategy at a
tiny batch (one row per micro-batch), timed beside the compared steps: each part is the pass's
measured part plus the planner's difference between the two batches. On a host where Python
between the ops, each call's cost and the scheduler set most of the step, those are the pass's
(a constant of the strategy); what grows with the batch is the planner's (docs/planning.md).
``compare`` sets the two waterfalls side by side: a part is compared relatively (within
``tol``, default 15%) when either side is at least ``floor`` (default 5%) of the measured
step, else in absolute time (within ``floor`` x step).
"""
import time

import numpy as np

from pdist.plan.host_costs import _op, host_op_cost, host_step_cost, memory_bandwidth  # noqa: F401 (re-exported)
from pdist.plan.presets import Cluster, Link
from pdist.plan.timing import as_measured

ALPHA_BYTES, BETA_BYTES, REPS = 8, 2 ** 20, 41
_links = {}               # (group name, world ranks, topology link) -> Link (this process)


def _collective_s(group, sizes, op="all_reduce"):
    """Median seconds of one blocking ``op`` ("all_reduce", or "all_gather" of sizes/n bytes from
    each rank) of each of ``sizes`` bytes (float64, a barrier before each), the statistic the
    compared steps use, under the job's own concurrency (every member calls); the sizes alternate
    call by call, so a drift in the machine's speed moves both medians alike."""
    from pdist.engine.backend import xp
    n = group.size
    bufs = [xp.ones(max(n, n * (s // (8 * n))), dtype="float64") for s in sizes]
    parts = [xp.ones(b.size // n, dtype="float64") for b in bufs]
    ts = [[] for _ in sizes]
    for _ in range(REPS):
        for buf, part, t in zip(bufs, parts, ts):
            group.barrier()
            t0 = time.perf_counter()
            group.all_reduce(buf) if op == "all_reduce" else group.all_gather(buf, part)
            t.append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in ts]


def calibrate(group, sizes=(ALPHA_BYTES, BETA_BYTES), op="all_reduce"):
    """The plain transport's Link of ``group`` (alpha-beta of its ``op``, module doc) from two
    message sizes in bytes (default 8 B and 1 MiB; a layout's own sizes where it passes them):
    collective over the group, cached per group and op; the simulated link is off while measuring.
    ``op`` "all_gather" for a group whose step is ZeRO's gathers and reduce-scatters: MPI picks
    another algorithm for them than for its all-reduce (on 2 nodes MPICH's all-reduce is
    node-aware and its all-gather is not), so one rate does not fit both."""
    key = (group.name, tuple(group.ranks), op)
    if group.size < 2:
        return Link(float("inf"), 0.0)
    if len(set(sizes)) != 2 or min(sizes) < 8:
        raise ValueError(f"calibrate: sizes must be two different byte counts >= 8, got {sizes}")
    if key not in _links:
        saved, group._link = getattr(group, "_link", None), None
        n = group.size
        try:
            steps, ring = (2 * (n - 1), 2 * (n - 1) / n) if op == "all_reduce" else (n - 1, (n - 1) / n)
            (s0, s1), (t_s, t_b) = sorted(sizes), _collective_s(group, sorted(sizes), op)
        finally:
            group._link = saved
        beta = ring * (s1 - s0) / max(t_b - t_s, 0.5 * t_b)     # noise: beta at most 2x t(big)'s
        alpha = max(0.0, t_s - ring * s0 / beta) / steps
        _links[key] = Link(beta, alpha)
    return _links[key]


def group_link(group, sizes=None, op="all_reduce"):
    """The Link the planner charges ``group``: the calibrated transport (at ``sizes``, of ``op``,
    calibrate) plus the simulated topology's link of that group, when one is set (module doc)."""
    base = calibrate(group, sizes or (ALPHA_BYTES, BETA_BYTES), op)
    sim = getattr(group, "_link", None)
    if sim is None or group.size < 2:
        return base
    return Link(1.0 / (1.0 / base.beta + sim.scale / sim.bw), base.alpha + sim.scale * sim.alpha)


def this_machine(rate, links=None, op_s=0.0, step_s=0.0):
    """A Cluster of this machine: ``rate`` FLOP/s per rank (the GEMM rate), the measured
    memory bandwidth, ``links`` {planner group: Link} (each group's own link, module doc),
    ``op_s``, ``step_s`` the host's seconds per op and per stepped tensor (host_op_cost)."""
    links = links or {}
    one = next(iter(links.values()), Link(1e30, 0.0))
    return Cluster("this machine (measured: GEMM rate, copy bandwidth, MPI alpha-beta per group)", 1 << 20,
                   float("inf"), {"fp32": rate, "fp64": rate, "mixed": rate, "fp8": rate}, intra=one, inter=one,
                   efficiency=1.0, mem_bw=memory_bandwidth(), reserve=0.0, overhead=0.0, op_s=op_s, step_s=step_s,
                   source="pdist.plan.measured", extra={"links": links})


def layout_of(model, batch):
    """(config, Layout, {planner group: ProcessGroup}) of a running strategy and its global
    ``batch`` (B rows, T tokens)."""
    from pdist.measure.waterfall import _config_of
    from pdist.plan.layout import Layout
    cfg = _config_of(model)
    if cfg is None:
        raise ValueError(f"plan_for: {type(model).__name__} holds no GPT/Llama config to plan")
    B, T = batch
    kw, groups, m = {"dp": 1, "tp": 1, "pp": 1}, {}, 1
    for s in model.chain():
        n = type(s).__name__
        if n == "HSDP":                  # ZeRO over the shard group, the shards all-reduced across replicas
            kw["dp"], kw["shard"], kw["zero"] = s.dp_world_size, s.group.size, s.stage
            groups["dp"], groups["dp_rep"] = s.group, s.replicate_group
        elif n in ("DataParallel", "DataParallelNaive", "ZeRO"):
            kw["dp"], groups["dp"] = s.group.size, s.group
            kw["zero"] = s.stage if n == "ZeRO" else 0
        elif n == "TensorParallel":
            kw["tp"], groups["tp"] = s.group.size, s.group
            kw["sp"] = bool(getattr(s, "sequence_parallel", False))
        elif n == "PipelineParallel":
            kw["pp"], groups["pp"], m = s.group.size, s.group, s.num_microbatches
            kw["schedule"] = s.schedule
        elif n not in ("Local",):
            raise ValueError(f"plan_for: the planner has no reading of {n} yet (chain {model.chain()})")
    rows = B // kw["dp"]
    if rows % m:
        raise ValueError(f"plan_for: batch {B} over dp {kw['dp']} does not split into m = {m} micro-batches")
    dtype = str(next(iter(model.parameters())).data.dtype)
    precision = {"float64": "fp64", "float32": "fp32"}.get(dtype, "mixed")
    lay = Layout(**kw, m=m, micro_batch=rows // m, seq_len=T, precision=precision,
                 recompute="full" if getattr(cfg, "recompute", "none") == "full" else "none")
    return cfg, lay, groups


def plan_for(model, batch, world=None, sizes=None):
    """The planner's plan of the running strategy ``model`` on global ``batch`` (B, T), on the
    measured profile of this machine (module doc); ``sizes`` {planner group: (small, big) bytes}:
    the all-reduce sizes its link is calibrated at (the first plan of a group sets it). Collective:
    every rank of the model calls it."""
    from pdist import comm
    from pdist.measure import flops
    from pdist.plan.model import plan_config
    cfg, lay, groups = layout_of(model, batch)
    world = world or (comm.get_world() if comm.is_initialized() else None)
    sizes = sizes or {}
    ops = {"dp": "all_gather" if lay.zero else "all_reduce"}     # ZeRO's dp group gathers and reduce-scatters
    links = {g: group_link(groups[g], sizes.get(g), ops.get(g, "all_reduce"))
             for g in ("tp", "dp", "pp", "dp_rep") if g in groups}   # one order, every rank
    rate, op_s, step_s = flops.gemm_rate(), host_op_cost(), host_step_cost()
    if world is not None:       # the best rank's, as the GEMM rate (load only adds)
        rate, op_s, step_s = (f(world.all_gather_object(v)) for f, v in ((max, rate), (min, op_s), (min, step_s)))
    cluster = this_machine(rate, links, op_s, step_s)
    link_of = lambda g: links.get(g, cluster.intra)       # noqa: E731
    out = plan_config(cfg, cluster, lay, link_of=link_of)
    parts = as_measured(out["waterfall"])
    parts["pipeline bubble"] += parts.pop("comm pp")      # the waterfall counts a pipeline's p2p as bubble
    out["measured_parts"] = {k: v for k, v in parts.items() if v or not k.startswith("comm ")}
    out["op_s"] = op_s
    out["calibration"] = {g: {"alpha_us": lk.alpha * 1e6, "beta_GBps": lk.beta / 1e9,
                              "simulated": getattr(getattr(groups[g], "_link", None), "name", None)}
                          for g, lk in links.items()}
    return out


def counted(groups, steps, stats=None):
    """{planner group: {"bytes", "steps"}} per step that pdist's groups counted (ProcessGroup.stats,
    or ``stats`` {group: such a dict} gathered over the steps: the ring accounting's bytes; ring
    steps per call as pdist/comm/topology.ring_steps) over ``steps`` steps since their stats were
    reset: what the planner's comm.group_bytes predicts."""
    from pdist.comm.topology import ring_steps
    out = {}
    for g, pg in groups.items():
        st = (stats[g] if stats is not None else pg.stats).items()
        out[g] = {"bytes": sum(v["bytes"] for _, v in st) / steps,
                  "steps": sum(v["calls"] * ring_steps(op, 2 if "send" in op or "recv" in op else pg.size)
                               for op, v in st) / steps}
    return out


def planned_counts(plan, pp_rank=0):
    """{group: {"bytes", "steps"}} per step the planner counts for pipeline rank ``pp_rank``."""
    st = plan["memory_per_stage"][pp_rank]
    return {g: {"bytes": st["comm_bytes"][g], "steps": st["comm_calls"][g]} for g in st["comm_bytes"]
            if st["comm_bytes"][g] or st["comm_calls"][g]}


def part_medians(steps):
    """{part: median over ``steps`` (each a {part: seconds} of one step) of that part}: every part's
    own median (a part missing from a step counts as 0 there), the statistic both sides use."""
    names = [k for k in dict.fromkeys(k for s in steps for k in s)]
    return {k: float(np.median([s.get(k, 0.0) for s in steps])) for k in names}


def anchor(planned, planned_tiny, measured_tiny):
    """The planner's parts at the compared batch, anchored on a calibration pass of the same strategy
    at a tiny batch: part_k = measured_tiny_k + planned_k - planned_tiny_k, never negative.

    What the planner's model cannot know on this host (the Python per op at these shapes, each
    collective's call cost and scheduling under the job's own concurrency, the private .step
    groups, the rank skew that waiting is, the Python between the passes) is the calibration's
    residual measured_tiny_k - planned_tiny_k, a constant of the strategy; what changes with the
    batch (GEMM FLOPs at the GEMM rate, elementwise bytes at the copy bandwidth, tp's activation
    bytes at the group's beta, the bubble's share of compute) is the planner's own difference."""
    names = list(dict.fromkeys(list(measured_tiny) + list(planned)))
    return {k: max(0.0, measured_tiny.get(k, 0.0) + planned.get(k, 0.0) - planned_tiny.get(k, 0.0)) for k in names}


def compare(measured, step_s, plan, tol=0.15, floor=0.05):
    """Rows (part, measured s, planned s, relative error or None, how, ok) for every part either
    side has; ``how`` is "rel" (within ``tol``) or "abs" (both under ``floor`` x step: within
    ``floor`` x step)."""
    planned = plan["measured_parts"] if "measured_parts" in plan else plan
    names = list(measured) + [k for k in planned if k not in measured]
    rows = []
    for k in names:
        m, p = measured.get(k, 0.0), planned.get(k, 0.0)
        if max(m, p) >= floor * step_s:
            err = (p - m) / m if m > 0 else float("inf")
            rows.append((k, m, p, err, "rel", abs(err) <= tol))
        else:
            rows.append((k, m, p, None, "abs", abs(p - m) <= floor * step_s))
    return rows


__all__ = ["part_medians", "anchor", "host_op_cost", "host_step_cost", "plan_for", "layout_of", "this_machine", "calibrate", "group_link", "compare", "counted", "planned_counts",
           "memory_bandwidth"]
