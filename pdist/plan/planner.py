"""A planner for real clusters: memory per GPU and time per step of a layout, from formulas.

    python -m pdist.plan --model gpt3-175b --cluster a100 --dp 8 --tp 8 --pp 16 --sp \\
        --recompute selective --global-batch 1536
    python -m pdist.plan --params 7.5e9 --dp 64 --zero 3 --precision mixed --json
    python -m pdist.plan --model gpt2-xl --cluster a100 --gpus 8 --global-batch 64 --search

    from pdist.plan import plan, search
    p = plan("gpt3-175b", "a100", dp=8, tp=8, pp=16, sp=True, recompute="selective", global_batch=1536)
    p["memory_per_gpu"]["total"], p["time_per_step"]["total"], p["mfu"]

Memory per GPU = params + grads + optimizer state (the ZeRO paper's (2 + 2 + 12)Ψ in mixed
precision, divided by stage; Rajbhandari et al. 2020) + activations (Korthikanti et al.
2022, Table 2, times the pipeline stash) + buffers (ZeRO-3's gathered units). Time per step
= compute ((6Ψ + 12Lsh)·tokens FLOPs, Narayanan et al. 2021, over peak × efficiency) +
bubble ((p−1)/(v·m) of compute; the zero-bubble schedules' own, model.bubble_ratio) + every group's collectives by α–β (t = steps·α + bytes/β)
over the link it crosses. The formulas, each beside the lesson that measures it:
pdist/plan/model.py and docs/planning.md. This module never imports MPI.
"""
import argparse
import json
import math
import sys
from dataclasses import replace

from pdist.models.gpt import GPTConfig
from pdist.plan.model import SCHEDULES, Layout, plan_config, plan_params
from pdist.plan.presets import CLUSTERS, MODELS

CATS = ("params", "grads", "optimizer", "activations", "buffers")


def _cluster(c):
    return CLUSTERS[c] if isinstance(c, str) else c


def plan(model, cluster="a100", layout=None, global_batch=0, efficiency=None, **kw):
    """The plan of one layout. ``model``: a GPTConfig, a preset name (pdist.plan.presets.MODELS)
    or a number Ψ (model states only); ``cluster``: a preset name or a Cluster; the layout as a
    Layout or as keywords (dp, tp, pp, zero, sp, schedule, m, v, recompute, precision,
    micro_batch, seq_len). Returns a dict: memory_per_gpu (bytes by category, the largest
    stage), memory_per_stage, fits, time_per_step (seconds by part), links, mfu,
    tflops_per_gpu, tokens_per_s, ..."""
    lay = replace(layout, **kw) if layout is not None else Layout(**kw)
    cl = _cluster(cluster)
    if isinstance(model, (int, float)):
        return plan_params(model, cl, lay, efficiency)
    cfg = MODELS[model] if isinstance(model, str) else model
    return plan_config(cfg, cl, lay, global_batch, efficiency)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model, cluster="a100", gpus=8, global_batch=0, precision="mixed", micro_batch=1, seq_len=0,
           efficiency=None, recompute=("none", "selective", "full")):
    """Every layout with dp·tp·pp = ``gpus`` (tp dividing the GPUs per node; SP on when tp > 1;
    1F1B for pp > 1; ZeRO 0–3, ZeRO-3 only without a pipeline; each recompute option) that fits
    in memory, ranked by predicted step time. ``global_batch`` (default gpus·micro_batch) sets m."""
    cl, cfg = _cluster(cluster), MODELS[model] if isinstance(model, str) else model
    B = global_batch or gpus * micro_batch
    out = []
    for tp in _divisors(math.gcd(gpus, cl.gpus_per_node)):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if B % (dp * micro_batch):
                continue
            for zero in range(4 if dp > 1 else 1):           # ZeRO shards over dp: nothing at dp = 1
                for rc in recompute:
                    lay = Layout(dp=dp, tp=tp, pp=pp, zero=zero, sp=tp > 1, recompute=rc, precision=precision,
                                 micro_batch=micro_batch, seq_len=seq_len)
                    try:
                        p = plan_config(cfg, cl, lay, B, efficiency)
                    except ValueError:
                        continue
                    if p["fits"]:
                        out.append(p)
    return sorted(out, key=lambda p: (round(p["time_per_step"]["total"], 9), p["memory_per_gpu"]["total"]))


def _gib(b):
    return "-" if b is None else f"{b / 2 ** 30:.2f}"


def _name(lay):
    s = f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} z{lay['zero']}"
    s += " sp" if lay["sp"] and lay["tp"] > 1 else ""
    s += f" {lay['schedule']} m{lay['m']}" + (f" v{lay['v']}" if lay["v"] > 1 else "") if lay["pp"] > 1 else ""
    return s + ("" if lay["recompute"] == "none" else f" rc:{lay['recompute']}")


def table(plans):
    """Plans as an aligned text table (GiB, seconds)."""
    head = ["layout", "params", "grads", "optim", "activ", "buffers", "total GiB", "fits", "step s", "compute",
            "bubble", "comm", "MFU", "tokens/s"]
    rows = []
    for p in plans:
        m, t = p["memory_per_gpu"], p["time_per_step"]
        row = [_name(p["layout"])] + [_gib(m[k]) for k in CATS] + [_gib(m["total"]), "yes" if p["fits"] else "NO"]
        if t is None:
            row += ["-"] * 6
        else:
            comm = sum(v for k, v in t.items() if k.startswith("comm_"))
            row += [f"{t['total']:.3g}", f"{t['compute']:.3g}", f"{t['bubble']:.3g}", f"{comm:.3g}",
                    f"{p['mfu']:.1%}", f"{p['tokens_per_s']:.4g}"]
        rows.append(row)
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(r))
                     for r in [head] + rows)


def text_chart(plans, capacity, width=50):
    """Memory bars per layout: P params, G grads, O optimizer, A activations, B buffers; | = capacity."""
    top = max([capacity] + [p["memory_per_gpu"]["total"] for p in plans])
    nw = max(len(_name(p["layout"])) for p in plans)
    lines = []
    for p in plans:
        m = p["memory_per_gpu"]
        bar = "".join(c * round((m[k] or 0) / top * width) for c, k in zip("PGOAB", CATS))
        cap = round(capacity / top * width)
        bar = (bar + " " * width)[:width + 1]
        bar = bar[:cap] + "|" + bar[cap:]
        lines.append(f"{_name(p['layout']):<{nw}} {bar} {_gib(m['total'])} GiB")
    lines.append(f"{'':{nw}} P params, G grads, O optimizer, A activations, B buffers; | = {_gib(capacity)} GiB per GPU")
    return "\n".join(lines)


def png_chart(plans, capacity, path):
    """Stacked memory bars per layout as a PNG (needs matplotlib); returns False without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(plans) + 1.5))
    left = [0.0] * len(plans)
    for k in CATS:
        vals = [(p["memory_per_gpu"][k] or 0) / 2 ** 30 for p in plans]
        ax.barh(range(len(plans)), vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals)]
    ax.axvline(capacity / 2 ** 30, color="k", linestyle="--", label="GPU memory")
    ax.set_yticks(range(len(plans)), [_name(p["layout"]) for p in plans])
    ax.set_xlabel("GiB per GPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return True


def _model(args):
    if args.params:
        return float(args.params)
    if args.n_layer:
        return GPTConfig(vocab_size=args.vocab_size, block_size=args.seq_len or 1024, n_layer=args.n_layer,
                         n_head=args.n_head, n_embd=args.n_embd)
    return MODELS[args.model]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pdist.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--params", type=float, default=None, help="Ψ alone: model-state memory only")
    for k, d in (("n_layer", 0), ("n_head", 12), ("n_embd", 768), ("vocab_size", 50257)):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=d, help="a GPT of this size (with --n-layer)")
    p.add_argument("--cluster", default="a100", choices=sorted(CLUSTERS))
    for k in ("dp", "tp", "pp", "m", "v", "micro_batch"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=1)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--precision", default="mixed", choices=["fp32", "fp64", "mixed"])
    p.add_argument("--global-batch", type=int, default=0, help="rows per step (sets m = B / (dp·micro-batch))")
    p.add_argument("--seq-len", type=int, default=0, help="default: the model's block_size")
    p.add_argument("--efficiency", type=float, default=None, help="achieved/peak FLOP/s (default: the cluster's)")
    p.add_argument("--search", action="store_true", help="rank every layout on --gpus that fits")
    p.add_argument("--gpus", type=int, default=0, help="GPUs for --search (default dp·tp·pp)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--png", metavar="PATH", default=None, help="memory bars as a PNG (matplotlib)")
    args = p.parse_args(argv)
    cl = CLUSTERS[args.cluster]
    model = _model(args)
    try:
        if args.search:
            if not isinstance(model, GPTConfig):
                p.error("--search needs a model (--model or --n-layer), not --params")
            plans = search(model, cl, args.gpus or args.dp * args.tp * args.pp, args.global_batch, args.precision,
                           args.micro_batch, args.seq_len, args.efficiency)[:args.top]
        else:
            lay = Layout(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero, sp=args.sp, schedule=args.schedule,
                         m=args.m, v=args.v, recompute=args.recompute, precision=args.precision,
                         micro_batch=args.micro_batch, seq_len=args.seq_len)
            plans = [plan(model, cl, lay, args.global_batch, args.efficiency)]
    except ValueError as e:
        p.error(str(e))
    if args.json:
        out = {"plans": plans} if args.search else plans[0]
        print(json.dumps(dict(out, cluster=cl.name, source=cl.source), indent=1))
        return 0
    psi = plans[0]["params"] if plans else (model if not isinstance(model, GPTConfig) else model.num_params())
    print(f"Ψ = {psi:,.0f} parameters; cluster: {cl.name}; {cl.gpus_per_node} GPUs per node, "
          f"{_gib(cl.memory)} GiB each; efficiency {plans[0]['efficiency'] if plans and 'efficiency' in plans[0] else cl.efficiency:.2f}\n")
    if not plans:
        print("no layout fits")
        return 1
    print(table(plans) + "\n")
    if args.png and png_chart(plans, cl.memory, args.png):
        print(f"wrote {args.png}")
    else:
        print(text_chart(plans, cl.memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
