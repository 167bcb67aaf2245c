"""The plan of one layout: memory per GPU (pdist.plan.memory), bytes per group (pdist.plan.comm),
time per step as the waterfall's parts (pdist.plan.timing), MFU.

    fits        the fullest pipeline rank's total ≤ fit_fraction (default 0.9) × the GPU's memory
    headroom    fit_fraction × memory − total, bytes (negative: does not fit)
    mfu         model FLOPs (Layout.flops convention) / (GPUs · peak · step time)
    tflops      hardware FLOP/s per GPU: the model FLOPs + recompute over the step time

The layout's refusals are pdist's (pdist.plan.layout; FSDP/ZeRO-3 with a pipeline word for word).
What pdist itself cannot run yet but the frameworks can (MoE with tp/pp/ZeRO, cp with tp/pp) is
planned, with a warning.
"""
from dataclasses import asdict

from pdist.plan.arch import arch_of
from pdist.plan.comm import GROUPS, comm_time, group_bytes, links
from pdist.plan.layout import Layout, bubble_ratio, crosses, stash, virtual_stages  # noqa: F401 (re-exported)
from pdist.measure.activation_memory import layer_activations  # noqa: F401 (re-exported)
from pdist.plan.memory import model_states, stage_memory  # noqa: F401 (re-exported)
from pdist.plan.presets import BYTES
from pdist.plan.timing import waterfall

FIT_FRACTION = 0.9
CATEGORIES = ("params", "grads", "grad_sum", "optimizer", "activations", "buffers", "logits", "temporaries",
              "held", "baseline", "reserve")


def warnings_of(a, lay, link):
    out = []
    if lay.pp > 1 and lay.m < lay.pp:
        out.append(f"m = {lay.m} < pp = {lay.pp}: the pipeline never fills (bubble {bubble_ratio(lay):.0%} of "
                   f"compute); raise --global-batch or lower --micro-batch")
    if link["tp"]:
        out.append(f"tp = {lay.tp} crosses nodes: Megatron's all-reduces run over the inter-node link")
    if a.moe and (lay.cp > 1 or (lay.tp > 1 and lay.sp)):
        out.append("pdist refuses a mixture of experts with cp > 1 or sequence parallelism (each rank would "
                   "route only its share of the tokens: the capacity and the aux loss would differ)")
    return out


def _stages(a, lay, cluster):
    out = []
    for r in range(lay.pp):
        mem, dense, experts, layers, ks = stage_memory(a, lay, r, cluster)
        sent, calls = group_bytes(a, lay, dense, experts, layers, ks, r)
        n = lay.zero_n                          # the elements this GPU's optimizer steps (its ZeRO shards)
        shard = sum(dense) / n + sum(experts) / max(1, n // lay.ep)
        out.append(dict(mem, comm_bytes=sent, comm_calls=calls, units=dense + experts, layers=layers, ks=ks,
                        shard=shard))
    return out


def plan_config(cfg, cluster, lay: Layout, global_batch=0, efficiency=None, fit_fraction=FIT_FRACTION,
                link_of=None):
    """The plan of one layout for a model config (GPTConfig, LlamaConfig, Arch): a dict.
    ``link_of``: group -> Link, each group's own link (pdist.plan.measured), instead of the
    cluster's intra or inter link by placement."""
    a = arch_of(cfg)
    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    if global_batch:
        if not (isinstance(lay.dp, int) and isinstance(lay.micro_batch, int) and lay.dp >= 1 and lay.micro_batch >= 1):
            lay.check()                                        # names the bad dp or micro_batch
        if global_batch % (lay.dp * lay.micro_batch):
            raise ValueError(f"global batch {global_batch} must divide into dp {lay.dp} x micro-batch "
                             f"{lay.micro_batch}")
        lay.m = global_batch // (lay.dp * lay.micro_batch)
    lay.check(a)
    s = lay.seq_len or a.seq
    tokens = lay.dp * lay.m * lay.micro_batch * s
    stages = _stages(a, lay, cluster)
    g = cluster.gpus_per_node
    link = links(lay, g)

    if link_of is None:
        def link_of(grp):
            return cluster.inter if link[grp] else cluster.intra
    comm = [comm_time(st["comm_bytes"], st["comm_calls"], link_of) for st in stages]
    for st, c in zip(stages, comm):    # HSDP: the replicas' all-reduce of the shard, on its own link, in dp
        if st["comm_calls"].get("dp_rep"):
            lk = link_of("dp_rep")
            c["dp"] += st["comm_calls"]["dp_rep"] * lk.alpha + st["comm_bytes"]["dp_rep"] / lk.beta
    flat = efficiency if efficiency is not None else (cluster.efficiency or None)
    peak = cluster.peak[lay.precision]
    model_flops = a.flops_per_token(s, lay.flops) * tokens
    parts = waterfall(a, lay, cluster, stages, comm, model_flops / lay.gpus / peak, flat)
    total = sum(parts.values())
    worst = max(stages, key=lambda d: d["total"])
    cap = fit_fraction * cluster.memory
    hw = a.flops_per_token(s) * tokens
    rec_flops = {"none": 0, "selective": 4 * a.n_layer * s * a.h,
                 "full": 2 * a.matmul_params() + 4 * a.n_layer * s * a.h}[lay.recompute] * tokens
    time = {"compute": parts["ideal_compute"] + parts["inefficiency"] + parts["recompute"] + parts["wait"],
            "bubble": parts["bubble"], **{f"comm_{k}": max(c[k] for c in comm) for k in GROUPS},
            "total": total}
    return {
        "memory_per_gpu": {k: worst[k] for k in CATEGORIES + ("total",)},
        "memory_per_stage": [{k: v for k, v in st.items() if k not in ("units", "layers", "ks", "shard")}
                             for st in stages],
        "fits": worst["total"] <= cap, "headroom": cap - worst["total"], "fit_fraction": fit_fraction,
        "time_per_step": time, "waterfall": parts,
        "exposed": {k: parts[f"comm:{k}"] for k in GROUPS},
        "links": {k: ("inter-node" if v or (k == "dp" and link.get("dp_rep")) else "intra-node")
                  for k, v in link.items() if k in GROUPS},
        "mfu": model_flops / lay.gpus / (peak * total),
        "tflops_per_gpu": (hw + rec_flops) / lay.gpus / total / 1e12, "peak": peak,
        "tokens_per_s": tokens / total,
        "global_batch": lay.dp * lay.m * lay.micro_batch, "seq_len": s, "params": a.num_params(),
        "active_params": a.num_params(active=True), "layout": asdict(lay), "gpus": lay.gpus,
        "efficiency": flat if flat else f"profile e_max {cluster.profile[0]}, d_half {cluster.profile[1]}",
        "warnings": warnings_of(a, lay, link),
    }


def plan_params(psi, cluster, lay, efficiency=None, fit_fraction=FIT_FRACTION):
    """Model-state memory only, from Ψ alone: one unit of ⌈Ψ/(t·p)⌉ per GPU."""
    lay.check()
    p_, g_, o_, gs = model_states([-(-int(psi) // (lay.tp * lay.pp))], lay)
    mem = {k: None for k in CATEGORIES}
    mem.update(params=p_, grads=g_, optimizer=o_, grad_sum=gs, total=p_ + g_ + o_ + gs)
    if lay.accounting != "paper":
        mem["reserve"] = round(cluster.reserve)
        mem["total"] += mem["reserve"]
    cap = fit_fraction * cluster.memory
    return {"memory_per_gpu": mem, "fits": mem["total"] <= cap, "headroom": cap - mem["total"],
            "time_per_step": None, "mfu": None, "tokens_per_s": None, "params": int(psi), "layout": asdict(lay),
            "gpus": lay.gpus, "warnings": [], "fit_fraction": fit_fraction}


__all__ = ["plan_config", "plan_params", "Layout", "layer_activations", "BYTES"]
