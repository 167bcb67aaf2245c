"""What ``python -m pdist.plan`` prints: the header of assumptions, the table, memory bars."""
from pdist.plan.comm import GROUPS

CATS = ("params", "grads", "optimizer", "activations", "buffers")
BAR = {"params": "P", "grads": "G", "grad_sum": "g", "optimizer": "O", "activations": "A", "buffers": "B",
       "logits": "L", "temporaries": "T", "held": "H", "baseline": "b", "reserve": "R"}


def gib(b):
    return "-" if b is None else f"{b / 2 ** 30:.2f}"


def name(lay):
    s = f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']}"
    s += "".join(f" {k}{lay[k]}" for k in ("cp", "ep") if lay.get(k, 1) > 1) + f" z{lay['zero']}"
    s += " sp" if lay["sp"] and lay["tp"] > 1 else ""
    s += f" {lay['schedule']} m{lay['m']}" + (f" v{lay['v']}" if lay["v"] > 1 else "") if lay["pp"] > 1 else ""
    return s + ("" if lay["recompute"] == "none" else f" rc:{lay['recompute']}")


def header(cluster, lay, plans, efficiency):
    """The assumptions, stated: peak, α, β, efficiency model, overlap, byte and memory accounting."""
    pk = cluster.peak[lay.precision] / 1e12
    if lay.precision == "fp8":                 # efficiency.py's _HIGH: what FP8 recipes leave in bf16
        pk = f"{pk:.4g} TFLOP/s (fp8 linears; attention and the head at {cluster.peak['mixed'] / 1e12:.4g} bf16)"
    else:
        pk = f"{pk:.4g} TFLOP/s ({lay.precision})"
    eff = (f"flat {efficiency:.2f}" if efficiency else f"flat {cluster.efficiency:.2f}" if cluster.efficiency else
           f"roofline per GEMM shape x profile e_max {cluster.profile[0]:.2f}, d_half {cluster.profile[1]} "
           f"(memory {cluster.mem_bw / 1e12:.2f} TB/s)")
    grads = ("fp32 main grads" if lay.grad_bytes(2) == 4 and lay.precision in ("mixed", "fp8") else
             "grads in the params' dtype")
    extra = {"paper": "the ZeRO paper's model states + Korthikanti's activations only",
             "pdist": "+ pdist's fp32 grad sum (mixed), ZeRO-2's full grad kept at m > 1",
             "deepspeed": "+ DeepSpeed's fp32 grad partition, ZeRO-2 sharded at every m",
             "megatron": "Megatron: main grads, distributed optimizer = ZeRO-1"}[lay.accounting]
    fit = plans[0]["fit_fraction"] if plans else 0.9
    lines = [
        f"cluster: {cluster.name}; {cluster.gpus_per_node} GPUs per node, {gib(cluster.memory)} GiB each",
        f"peak {pk}; intra-node beta {cluster.intra.beta / 1e9:.3g} GB/s alpha "
        f"{cluster.intra.alpha * 1e6:.3g} us; inter-node beta {cluster.inter.beta / 1e9:.3g} GB/s alpha "
        f"{cluster.inter.alpha * 1e6:.3g} us (per GPU per direction)",
        f"efficiency: {eff}",
        "overlap: " + ("dp behind backward, ZeRO-3 gather behind the previous unit, pp p2p in the steady state, "
                       "cp ring behind attention; tp and ep exposed" if lay.overlap else "none (every collective "
                                                                                       "exposed: a bound)"),
        "bytes: ring accounting (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n per byte), "
        f"FLOPs {lay.flops}",
        f"memory: {lay.accounting} accounting, {grads}, {extra}; reserve {gib(cluster.reserve)} GiB + 5% "
        f"fragmentation{' (not counted)' if lay.accounting == 'paper' else ''}; fits = under {fit:.0%} of "
        f"{gib(cluster.memory)} GiB",
    ]
    if cluster.baseline and lay.accounting != "paper":
        lines[-1] += f"; + the process's baseline {cluster.baseline / 2 ** 20:.1f} MiB and ZeRO's pool (held)"
    if lay.offload != "none":
        what = "optimizer, fp32 grads" + (", param and grad shards" if lay.offload == "params" else "")
        lines.append(f"offload: {lay.offload} to the host ({what}); PCIe {cluster.pcie / 1e9:g} GB/s, CPU Adam "
                     f"over {cluster.host_bw / 1e9:g} GB/s of host memory per GPU, in the step's overhead")
    return "\n".join(lines)


def table(plans):
    """Plans as an aligned text table: memory GiB, time s, exposed communication per group, links."""
    head = ["layout", "params", "grads", "optim", "activ", "other", "total GiB", "fits", "step s", "compute",
            "bubble"] + [f"{g} s" for g in GROUPS] + ["MFU", "tokens/s", "inter-node", "ties"]
    rows = []
    for p in plans:
        m, t = p["memory_per_gpu"], p["time_per_step"]
        other = sum(m.get(k) or 0 for k in ("grad_sum", "buffers", "logits", "temporaries", "held", "baseline",
                                                "reserve"))
        row = [name(p["layout"])] + [gib(m[k]) for k in ("params", "grads", "optimizer", "activations")]
        row += [gib(other), gib(m["total"]), "yes" if p["fits"] else "NO"]
        if t is None:
            row += ["-"] * (3 + len(GROUPS) + 3)
        else:
            ex = p["exposed"]
            row += [f"{t['total']:.3g}", f"{t['compute']:.3g}", f"{t['bubble']:.3g}"]
            row += [f"{ex[g]:.3g}" if t[f"comm_{g}"] else "-" for g in GROUPS]
            row += [f"{p['mfu']:.1%}", f"{p['tokens_per_s']:.4g}",
                    ",".join(g for g, v in p["links"].items() if v == "inter-node" and t[f"comm_{g}"]) or "-"]
        row.append(str(p.get("ties", "")) if p.get("ties") else "")
        rows.append(row)
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip()
                     for r in [head] + rows)


def text_chart(plans, capacity, width=50):
    """Memory bars per layout (letters: BAR); | = capacity."""
    top = max([capacity] + [p["memory_per_gpu"]["total"] for p in plans])
    nw = max(len(name(p["layout"])) for p in plans)
    lines = []
    for p in plans:
        m = p["memory_per_gpu"]
        bar = "".join(c * round((m.get(k) or 0) / top * width) for k, c in BAR.items())
        cap = round(capacity / top * width)
        bar = (bar + " " * width)[:width + 1]
        bar = bar[:cap] + "|" + bar[cap:]
        lines.append(f"{name(p['layout']):<{nw}} {bar} {gib(m['total'])} GiB")
    legend = ", ".join(f"{c} {k}" for k, c in BAR.items())
    lines.append(f"{'':{nw}} {legend}; | = {gib(capacity)} GiB per GPU")
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
    for k in BAR:
        vals = [(p["memory_per_gpu"].get(k) or 0) / 2 ** 30 for p in plans]
        ax.barh(range(len(plans)), vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals)]
    ax.axvline(capacity / 2 ** 30, color="k", linestyle="--", label="GPU memory")
    ax.set_yticks(range(len(plans)), [name(p["layout"]) for p in plans])
    ax.set_xlabel("GiB per GPU")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return True
