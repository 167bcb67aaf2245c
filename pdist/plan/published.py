"""The published training runs the planner is held to (pdist/plan/cases.json, docs/planning.md).

Each case names its source in words (paper, year, table or section), the quantity reported, the
layout the source gives (what it leaves out is in ``assumed``), and a tolerance fixed before any
prediction was read: 2% for a quantity a published formula gives (parameter counts, model-state
memory), 15% for a measured one (TFLOP/s, MFU, tokens/s). ``fitted``: the case was used to set a
preset's constant (the GEMM profile), so it is not an independent check.

    python -m pdist.plan.published            # the table docs/planning.md holds, recomputed
    python -m pdist.plan.published --check    # exit 1 when the stored verdicts are stale
    python -m pdist.plan.published --update   # store the planner's values and verdicts in cases.json

``added``: the date a case joined the table (its tolerance fixed then, before its prediction was read);
the table counts those added after the planner's constants were set separately.

Quantities: ``params_b``/``active_params_b`` (10⁹), ``states_gb`` (params + grads + fp32 grad sum +
optimizer + ZeRO-3 buffers per GPU, 10⁹ bytes), ``tflops_eq3`` (Narayanan et al. 2021, Eq. 3
FLOPs over the predicted step), ``tflops`` (the planner's hardware FLOP/s per GPU), ``mfu``,
``tokens_per_gpu_s``, and (``DERIVED``) ``step_s``, ``tokens_per_s``, ``hfu``, ``gpu_hours_per_t_tokens``,
``memory_gb``. ``cluster``: a preset, or a preset with the CLI's edits (``_cluster``).
"""
import json
import os
import sys
from dataclasses import fields, replace

from pdist.plan.arch import Arch, arch_of
from pdist.plan.layout import Layout
from pdist.plan.planner import plan
from pdist.plan.presets import CLUSTERS, MODELS, GiB, Link, narayanan_flops

# quantities read off a plan directly: seconds per step, tokens/s of the job, hardware FLOPs utilization,
# GPU hours per 10¹² tokens, the fullest GPU's memory (10⁹ bytes)
DERIVED = {"step_s": lambda p: p["time_per_step"]["total"], "tokens_per_s": lambda p: p["tokens_per_s"],
           "hfu": lambda p: p["tflops_per_gpu"] * 1e12 / p["peak"],
           "gpu_hours_per_t_tokens": lambda p: 1e12 * p["gpus"] / p["tokens_per_s"] / 3600,
           "memory_gb": lambda p: p["memory_per_gpu"]["total"] / 1e9}

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases.json")


def load(path=PATH):
    with open(path) as f:
        return json.load(f)["cases"]


def _model(c):
    m = c.get("model")
    try:
        return MODELS[m] if isinstance(m, str) else Arch(**m) if isinstance(m, dict) else None
    except KeyError:
        raise ValueError(f"case {c['id']}: unknown model preset {m!r}; one of {', '.join(sorted(MODELS))}, "
                         f"or a dict of Arch fields")
    except TypeError as e:
        raise ValueError(f"case {c['id']}: model: {e}; the fields are {', '.join(fields_of(Arch))}")


def fields_of(cls):
    return [f.name for f in fields(cls)]


CLUSTER_EDITS = {"gpu_memory_gib": ("memory", GiB), "gpus_per_node": ("gpus_per_node", 1),
                 "intra_bw_gbs": ("intra", 1e9), "inter_bw_gbs": ("inter", 1e9), "peak_tflops": ("peak", 1e12),
                 "mem_bw_tbs": ("mem_bw", 1e12), "pcie_gbs": ("pcie", 1e9), "reserve_gib": ("reserve", GiB)}


def _cluster(c):
    """A preset name, or {"preset": name, edits}: gpu_memory_gib, gpus_per_node, intra_bw_gbs and
    inter_bw_gbs (per GPU per direction), peak_tflops (at the layout's precision), mem_bw_tbs, pcie_gbs,
    reserve_gib: the CLI's cluster flags, for a case on hardware no preset holds."""
    cl = c.get("cluster", "a100")
    if isinstance(cl, str):
        return cl
    base = CLUSTERS[cl["preset"]]
    edits = {}
    for k, v in cl.items():
        if k == "preset":
            continue
        if k not in CLUSTER_EDITS:
            raise ValueError(f"case {c['id']}: unknown cluster edit {k!r}; use one of {', '.join(CLUSTER_EDITS)}")
        f, unit = CLUSTER_EDITS[k]
        if f in ("intra", "inter"):
            edits[f] = Link(v * unit, getattr(base, f).alpha)
        elif f == "peak":
            edits[f] = dict(base.peak, **{c.get("layout", {}).get("precision", "mixed"): v * unit})
        else:
            edits[f] = v * unit
    return replace(base, name=f"{base.name} (edited: {', '.join(sorted(edits))})", **edits)


def predict(c):
    """The planner's value of the case's quantity."""
    q, model = c["quantity"], _model(c)
    if q in ("params_b", "active_params_b"):
        return arch_of(model).num_params(active=q == "active_params_b") / 1e9
    bad = set(c.get("layout", {})) - set(fields_of(Layout))
    if bad:
        raise ValueError(f"case {c['id']}: unknown layout keys {sorted(bad)}; the keys are {', '.join(fields_of(Layout))}")
    p = plan(c["params"] if model is None else model, _cluster(c), global_batch=c.get("global_batch", 0),
             **c.get("layout", {}))
    if q in DERIVED:
        return DERIVED[q](p)
    if q == "states_gb":
        m = p["memory_per_gpu"]
        return sum(m[k] or 0 for k in ("params", "grads", "grad_sum", "optimizer", "buffers")) / 1e9
    if q == "tflops_eq3":
        a = arch_of(model)
        return narayanan_flops(p["global_batch"], p["seq_len"], a.n_layer, a.h, a.vocab) / p["gpus"] / \
            p["time_per_step"]["total"] / 1e12
    if q == "tflops":
        return p["tflops_per_gpu"]
    if q == "mfu":
        return p["mfu"]
    if q == "tokens_per_gpu_s":
        return p["tokens_per_s"] / p["gpus"]
    raise ValueError(f"case {c['id']}: unknown quantity {q!r}; one of params_b, active_params_b, states_gb, "
                     f"tflops_eq3, tflops, mfu, tokens_per_gpu_s, {', '.join(DERIVED)}")


def verdicts(cases=None):
    """[(case, predicted, relative error, within tolerance)] for every case."""
    out = []
    for c in cases or load():
        v = predict(c)
        err = v / c["reported"] - 1
        out.append((c, v, err, abs(err) <= c["tolerance"]))
    return out


def markdown(rows):
    head = "| # | source | quantity | reported | planned | error | tol. | verdict |\n|---|---|---|---|---|---|---|---|"
    lines = [head]
    for c, v, err, ok in rows:
        tag = " (fitted)" if c.get("fitted") else ""
        lines.append(f"| {c['id']} | {c['source']} | {c['quantity']} | {c['reported']:.4g} | {v:.4g} | "
                     f"{err:+.1%} | {c['tolerance']:.0%} | {'hit' if ok else 'miss'}{tag} |")
    n, hit = len(rows), sum(ok for *_, ok in rows)
    ind = [r for r in rows if not r[0].get("fitted")]
    lines.append(f"\nWithin tolerance: {hit} of {n}; of the {len(ind)} not used to fit anything, "
                 f"{sum(ok for *_, ok in ind)}.")
    for day in sorted({r[0]["added"] for r in rows if r[0].get("added")}):
        new = [r for r in rows if r[0].get("added") == day]
        lines[-1] += f" Of the {len(new)} added {day}, {sum(ok for *_, ok in new)}."
    return "\n".join(lines)


def stale(rows):
    """Cases whose stored ``planned``/``verdict`` differ from what the planner computes now."""
    return [c["id"] for c, v, _, ok in rows
            if c.get("verdict") != ("hit" if ok else "miss") or abs(c.get("planned", 0) - float(f"{v:.4g}")) >
            1e-9 * max(1, abs(v))]


def update(rows, path=PATH):
    """Write each case's ``planned`` (4 significant digits) and ``verdict`` into cases.json."""
    with open(path) as f:
        data = json.load(f)
    got = {c["id"]: (float(f"{v:.4g}"), "hit" if ok else "miss") for c, v, _, ok in rows}
    for c in data["cases"]:
        c["planned"], c["verdict"] = got[c["id"]]
    with open(path, "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rows = verdicts()
    if "--update" in argv:
        update(rows)
    if "--check" in argv:
        bad = stale(rows)
        print("stale: " + ", ".join(bad) if bad else "cases.json is up to date")
        return 1 if bad else 0
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
