"""Time per step as the waterfall's parts (pdist/measure/waterfall.py names them the same).

    ideal_compute   model FLOPs (the MFU's convention) / (GPUs · peak)
    inefficiency    the mean stage's compute (GEMMs by pdist.plan.efficiency's roofline and
                    profile, attention scores, memory-bound elementwise work, and the host's
                    m · ops · op_s: Arch.host_ops per micro-batch times the cluster's per-op host
                    cost, 0 on the GPU presets) − ideal_compute
    recompute       the forward again (full) or the attention scores again (selective)
    bubble          bubble_ratio (pdist.plan.layout) × the slowest stage's compute + recompute
    comm:<group>    what overlap leaves exposed of each group's α–β time (below)
    wait            the slowest pipeline stage's compute − the mean stage's (uneven layers, the head)
    overhead        the cluster's framework overhead per step (0 unless measured: ``this``), plus
                    the optimizer's host cost: step_s per tensor it steps (Arch.host_tensors; a
                    ZeRO optimizer steps one flat shard per unit), the slowest stage's; and an offloaded
                    optimizer's PCIe transfers and CPU Adam (``offload_time``)

Overlap (``Layout.overlap``; off: every collective exposed, the sum a bound):

    tp   exposed (Megatron's all-reduces sit between the GEMMs that need them)
    dp   ZeRO 0-2: hidden behind the last micro-batch's backward (and, the all-gather of ZeRO 1-2,
         the first one's forward), never less than one unit's share (the last bucket);
         ZeRO-3: each unit's gather behind the previous unit's compute: exposed what exceeds
         the step's compute, at least one unit's share
    pp   p2p overlaps the steady state; the 2(p−1) sends of warm-up and cool-down are exposed
    cp   ring: hidden behind the attention it feeds (Liu et al. 2023); Ulysses: exposed
    ep   exposed, except under DualPipeV, which overlaps one chunk's all-to-all with the
         other's compute (DeepSeek-V3 report, §3.2.1): exposed what exceeds the compute
"""
from pdist.plan.comm import GROUPS
from pdist.plan.efficiency import head_time, layer_time
from pdist.plan.layout import bubble_ratio
from pdist.plan.presets import BYTES

ADAM_HOST_BYTES = 28      # CPU Adam per element: read fp32 param, grad, m, v (16), write param, m, v (12)

# the measured waterfall's labels (pdist/measure/waterfall.py) for the planner's keys
MEASURED_LABELS = {"ideal_compute": "ideal compute", "inefficiency": "kernel inefficiency",
                   "recompute": "recompute", "bubble": "pipeline bubble", "wait": "waiting for slower rank",
                   "overhead": "framework overhead", **{f"comm:{g}": f"comm {g}" for g in GROUPS}}


def as_measured(parts):
    """The planner's waterfall under the measured waterfall's labels, to set the two side by side."""
    return {MEASURED_LABELS[k]: v for k, v in parts.items()}


def stage_compute(a, lay, cluster, layers, last, flat):
    """(forward, recompute, attention) seconds of one micro-batch on one GPU of a stage."""
    tokens = lay.micro_batch * (lay.seq_len or a.seq) // lay.cp
    fwd = rec = att = 0.0
    for i in layers:
        g, sc, el = layer_time(a, lay, tokens, cluster, flat, a.moe and i >= a.n_dense)
        fwd += g + sc + el
        att += sc
        rec += {"none": 0.0, "selective": sc, "full": g + sc + el}[lay.recompute]
    if last:
        fwd += head_time(a, lay, tokens, cluster, flat)
    return fwd, rec, att


def offload_time(lay, cluster, shard):
    """Seconds per step an offloaded optimizer adds (ZeRO-Offload, Ren et al. 2021, §4: the gradient shard
    to the host and the updated params back over PCIe, then CPU Adam, memory-bound: 28 bytes per element
    over the host's memory bandwidth; not overlapped). ZeRO-Infinity (offload "params") also fetches the
    param shard over PCIe for each micro-batch's forward and backward: 2m·k_p per element more."""
    if lay.offload == "none":
        return 0.0
    kp, kg = BYTES[lay.precision][0], lay.grad_bytes(BYTES[lay.precision][1])
    pcie = (kg + kp + (2 * lay.m * kp if lay.offload == "params" else 0)) * shard
    return pcie / cluster.pcie + ADAM_HOST_BYTES * shard / cluster.host_bw


def _exposed(lay, t, calls, st, compute, n_units):
    """Seconds of each group's time that overlap leaves on the critical path."""
    if not lay.overlap:
        return dict(t)
    fwd = st["fwd"]
    out = {"tp": t["tp"]}
    if lay.zero < 3:
        hide = 2 * fwd + (fwd if lay.zero else 0)
        out["dp"] = max(t["dp"] / max(1, n_units), t["dp"] - hide) if t["dp"] else 0.0
    else:
        out["dp"] = max(t["dp"] / max(1, n_units), t["dp"] - compute) if t["dp"] else 0.0
    out["pp"] = t["pp"] * min(1.0, 2 * (lay.pp - 1) / calls["pp"]) if calls["pp"] else 0.0
    out["cp"] = max(0.0, t["cp"] - 3 * lay.m * st["att"]) if lay.cp_mode == "ring" else t["cp"]
    out["ep"] = max(0.0, t["ep"] - compute) if lay.schedule == "dualpipev" else t["ep"]
    return out


def waterfall(a, lay, cluster, stages, comm, ideal, flat=None):
    """The parts of one step (seconds per GPU); ``stages``: per pipeline rank dicts with layers, ks,
    comm_calls, units; ``comm``: per pipeline rank {group: α–β seconds}."""
    V = lay.pp * lay.v
    per = []
    for st in stages:
        fwd, rec, att = stage_compute(a, lay, cluster, st["layers"], V - 1 in st["ks"], flat)
        st.update(fwd=fwd, att=att)
        host = lay.m * a.host_ops(st["layers"], 0 in st["ks"], V - 1 in st["ks"], lay.tp) * cluster.op_s
        per.append((3 * lay.m * fwd + host, lay.m * rec))
    mean = sum(c for c, _ in per) / len(per)
    slow = max(range(len(per)), key=lambda i: per[i][0] + per[i][1])
    c_max, r_max = per[slow]
    parts = {"ideal_compute": ideal, "inefficiency": max(0.0, mean - ideal), "recompute": r_max,
             "bubble": bubble_ratio(lay) * (c_max + r_max)}
    exposed = {g: 0.0 for g in GROUPS}
    for (c, r), st, t in zip(per, stages, comm):
        e = _exposed(lay, t, st["comm_calls"], st, c + r, len(st["units"]))
        exposed = {g: max(exposed[g], e[g]) for g in GROUPS}
    parts.update({f"comm:{g}": exposed[g] for g in GROUPS})
    parts["wait"] = c_max - mean
    steps = [a.host_tensors(st["layers"], 0 in st["ks"], V - 1 in st["ks"]) if not lay.zero else len(st["units"])
             for st in stages]
    parts["overhead"] = cluster.overhead + max(steps) * cluster.step_s + max(
        offload_time(lay, cluster, st.get("shard", 0)) for st in stages)
    return parts
