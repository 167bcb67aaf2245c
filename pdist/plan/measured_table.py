"""The planner beside the measured waterfall, as a table (bench/plan_vs_measured.py, tests).

``side_by_side(result)`` takes one layout's result of tests/workers/plan_measured_worker.py
(per rank: the median step's waterfall parts, its step time, the counted bytes and ring steps
per group; the plan's parts under the waterfall's labels) and returns the measured parts (the
mean over ranks of each rank's median step), the step, and ``measured.compare``'s rows.
``render(name, result)`` prints it: one row per part, ms measured and planned, the error and
the verdict, then the communication counted by pdist's groups beside the planner's count.
"""
from pdist.plan.measured import compare

UNMODELLED = ".step"        # the strategies' private step groups (loss and statistics): no planner part


def side_by_side(result, tol=0.15, floor=0.05):
    """(measured parts, step seconds, rows) of one layout (module doc)."""
    ranks = result["ranks"]
    names = []
    for r in ranks:
        names += [k for k in r["parts"] if k not in names]
    parts = {k: sum(r["parts"].get(k, 0.0) for r in ranks) / len(ranks) for k in names}
    step = sum(r["step_s"] for r in ranks) / len(ranks)
    return parts, step, compare(parts, step, result["plan"], tol, floor)


def counts_agree(result, rel=1e-9):
    """{group: (counted bytes, planned bytes, counted steps, planned steps, bytes agree)} on rank 0."""
    r = result["ranks"][0]
    out = {}
    for g, c in r["counted"].items():
        p = r["planned"].get(g, {"bytes": 0.0, "steps": 0})
        out[g] = (c["bytes"], p["bytes"], c["steps"], p["steps"], abs(c["bytes"] - p["bytes"]) <= rel * c["bytes"])
    return out


def render(name, result, tol=0.15, floor=0.05):
    parts, step, rows = side_by_side(result, tol, floor)
    lines = [f"{name}: step {step * 1e3:.2f} ms (mean over {len(result['ranks'])} ranks of each one's median step)",
             f"  {'part':28s} {'measured ms':>12s} {'planned ms':>11s} {'error':>8s}  verdict"]
    for k, m, p, err, how, ok in rows:
        note = "not modelled" if UNMODELLED in k else (f"relative, tolerance {tol:.0%}" if how == "rel" else
                                                         f"both < {floor:.0%} of the step")
        e = "" if err is None else ("inf" if err == float("inf") else f"{err:+.0%}")
        lines.append(f"  {k:28s} {m * 1e3:12.3f} {p * 1e3:11.3f} {e:>8s}  {'ok' if ok else 'MISS'} ({note})")
    if "op_s" in result:
        lines.append(f"  host cost per op (calibrated): {result['op_s'] * 1e6:.1f} us")
    med = lambda xs: sorted(xs)[len(xs) // 2]      # noqa: E731
    lines.append("  sum of parts / step per rank (median over its steps): "
                 + ", ".join(f"{med(r['ratios']):.4f}" for r in result["ranks"]))
    for g, (cb, pb, cs, ps, ok) in counts_agree(result).items():
        link = result.get("calibration", {}).get(g, {})
        lines.append(f"  {g}: bytes/step counted {cb:.0f}, planned {pb:.0f} ({'equal' if ok else 'DIFFER'}); "
                     f"ring steps counted {cs:g}, planned {ps:g}; link alpha {link.get('alpha_us', 0):.1f} us, "
                     f"beta {link.get('beta_GBps', 0):.3f} GB/s" + (f" (+ simulated {link['simulated']})"
                                                                     if link.get("simulated") else ""))
    return "\n".join(lines)


__all__ = ["side_by_side", "counts_agree", "render"]
