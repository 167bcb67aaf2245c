"""The planner's API: ``plan`` one layout, ``search`` every layout of a GPU count.

    from pdist.plan import plan, search
    p = plan("gpt3-175b", "a100", dp=8, tp=8, pp=16, sp=True, recompute="selective", global_batch=1536)
    p["memory_per_gpu"]["total"], p["time_per_step"]["total"], p["waterfall"], p["mfu"]
    search("mixtral-8x7b", "h100", gpus=64, global_batch=256)   # fits, ranked by time, then headroom

The formulas: pdist/plan/{arch,memory,comm,efficiency,timing}.py and docs/planning.md.
"""
import math
from dataclasses import replace

from pdist.plan.arch import arch_of
from pdist.plan.model import FIT_FRACTION, Layout, plan_config, plan_params
from pdist.plan.presets import CLUSTERS, MODELS


def cluster_of(c):
    if isinstance(c, str):
        if c not in CLUSTERS:
            raise ValueError(f"unknown cluster {c!r}: one of {', '.join(sorted(CLUSTERS))}, or a Cluster")
        if c == "this":                    # the nodes of the launch it runs in, if several (here.py)
            from pdist.plan.here import this_cluster
            return this_cluster()
        return CLUSTERS[c]
    return c


def model_of(m):
    if isinstance(m, str):
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}: one of {', '.join(sorted(MODELS))}, or a config")
        return MODELS[m]
    return m


def plan(model, cluster="a100", layout=None, global_batch=0, efficiency=None, fit_fraction=FIT_FRACTION, **kw):
    """The plan of one layout. ``model``: a GPTConfig, LlamaConfig, Arch, a preset name
    (pdist.plan.presets.MODELS) or a number Ψ (model states only); ``cluster``: a preset name or
    a Cluster; the layout as a Layout or as keywords (dp, tp, pp, cp, ep, zero, sp, schedule, m, v,
    recompute, precision, micro_batch, seq_len, cp_mode, grad_dtype, accounting, overlap, flops).
    Returns a dict: memory_per_gpu (bytes by category, the fullest stage), memory_per_stage, fits,
    headroom, time_per_step, waterfall (the measured waterfall's parts), exposed, links, mfu,
    tflops_per_gpu, tokens_per_s, warnings, ..."""
    lay = replace(layout, **kw) if layout is not None else Layout(**kw)
    cl = cluster_of(cluster)
    if isinstance(model, (int, float)):
        return plan_params(model, cl, lay, efficiency, fit_fraction)
    return plan_config(model_of(model), cl, lay, global_batch, efficiency, fit_fraction)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(a, gpus, gpn, cps, base):
    """Every (dp, tp, pp, cp, ep, zero) with dp·tp·pp·cp = gpus, tp dividing the GPUs per node."""
    for cp in cps:
        if gpus % cp:
            continue
        for tp in _divisors(math.gcd(gpus // cp, gpn)):
            for pp in _divisors(gpus // (cp * tp)):
                dp = gpus // (cp * tp * pp)
                eps = [e for e in _divisors(dp) if a.n_expert % e == 0] if a.moe else [1]
                for ep in eps:
                    for zero in range(4 if dp * cp > 1 else 1):      # ZeRO shards over dp·cp
                        yield replace(base, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=tp > 1)


def search(model, cluster="a100", gpus=8, global_batch=0, precision="mixed", micro_batch=1, seq_len=0,
           efficiency=None, recompute=("none", "selective", "full"), fit_fraction=FIT_FRACTION, cps=(1,),
           collapse=True, **kw):
    """Every layout on ``gpus`` GPUs (tp inside a node, SP on when tp > 1, 1F1B when pp > 1, ZeRO
    0-3 (not 3 with a pipeline: pdist's refusal), ep over the divisors of dp and E, cp over
    ``cps``, each recompute option) that fits, ranked by predicted step time, then headroom
    (most first). ``collapse``: layouts that differ only in their ZeRO stage and whose times agree to
    3 significant digits are one row, the one with the most headroom (``ties`` counts the others). ``global_batch`` (default
    gpus·micro_batch) sets m."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")
    cl, cfg = cluster_of(cluster), model_of(model)
    a = arch_of(cfg)
    B = global_batch or gpus * micro_batch
    base = Layout(precision=precision, micro_batch=micro_batch, seq_len=seq_len, **kw)
    out = []
    for lay in _layouts(a, gpus, cl.gpus_per_node, cps, base):
        if B % (lay.dp * micro_batch):
            continue
        for rc in recompute:
            try:
                p = plan_config(cfg, cl, replace(lay, recompute=rc), B, efficiency, fit_fraction)
            except ValueError:
                continue
            if p["fits"]:
                out.append(p)
    out.sort(key=lambda p: (float(f"{p['time_per_step']['total']:.3g}"), -p["headroom"],
                            p["layout"]["zero"], p["layout"]["pp"]))
    if not collapse:
        return out
    kept = {}
    for p in out:
        lay = p["layout"]
        key = (f"{p['time_per_step']['total']:.3g}",) + tuple(lay[k] for k in ("dp", "tp", "pp", "cp", "ep", "recompute"))
        if key in kept:
            kept[key]["ties"] += 1
            continue
        p["ties"] = 0
        kept[key] = p
    return list(kept.values())
