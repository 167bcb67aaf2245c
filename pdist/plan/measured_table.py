"""The planner beside the measured waterfall, as a table (bench/plan_vs_measured.py, tests).

``side_by_side(result)`` takes one layout's result of tests/workers/plan_measured_worker.py
(per rank: each part's median over the steps, the median step, the counted bytes and ring
steps per group; the planner's parts under the waterfall's labels, anchored on the tiny-batch
calibration pass: pdist.plan.measured.anchor) and returns the measured parts (the mean over
ranks), the step, and ``measured.compare``'s rows. ``blocked_row`` compares the time blocked in
collectives as one part (waiting for slower rank + every comm group). ``render(name, result)``
prints it: one row per part, ms measured and planned, the error and the verdict, the blocked
row, then the communication counted by pdist's groups beside the planner's count.
"""
from pdist.plan.measured import compare

UNMODELLED = ".step"        # the strategies' private step groups (loss and statistics): no planner part
WAIT, BLOCKED = "waiting for slower rank", "waiting + comm (blocked)"


def blocked(parts):
    """Seconds blocked in collectives: waiting for slower rank + every comm group (not the bubble)."""
    return sum(v for k, v in parts.items() if k == WAIT or k.startswith("comm "))


def blocked_row(result, tol=0.15, floor=0.05):
    """compare's row of the blocked time as one part (waiting and comm: how the host's scheduler
    splits a collective's time between them is not the planner's to know, module doc)."""
    parts, step, _ = side_by_side(result, tol, floor)
    return compare({BLOCKED: blocked(parts)}, step, {BLOCKED: blocked(result["plan"])}, tol, floor)[0]


def side_by_side(result, tol=0.15, floor=0.05):
    """(measured parts, step seconds, rows) of one layout (module doc)."""
    ranks = result["ranks"]
    names = []
    for r in ranks:
        names += [k for k in r["parts"] if k not in names]
    parts = {k: sum(r["parts"].get(k, 0.0) for r in ranks) / len(ranks) for k in names}
    step = sum(r["step_s"] for r in ranks) / len(ranks)
    return parts, step, compare(parts, step, result["plan"], tol, floor)


def held_rows(result, shared, tol=0.15, floor=0.05):
    """The rows tests/test_plan_measured.py holds (docs/planning.md says why): every part by compare's
    rule, except waiting, held in absolute time (within ``floor`` x step) when the ranks have a core
    each, and, when they share cores (``shared``), waiting and the comm groups held only as their sum
    (blocked_row)."""
    _, step, rows = side_by_side(result, tol, floor)
    out = []
    for k, m, p, err, how, ok in rows:
        if shared and (k == WAIT or k.startswith("comm ")):
            continue
        out.append((k, m, p, None, "abs", abs(p - m) <= floor * step) if k == WAIT else (k, m, p, err, how, ok))
    return out + ([blocked_row(result, tol, floor)] if shared else [])


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
    model, tiny = result.get("model", {}), result.get("tiny", {})
    lines = [f"{name}: step {step * 1e3:.2f} ms (mean over {len(result['ranks'])} ranks of each one's median step); "
             f"calibration pass {result.get('tiny_rows')} rows",
             f"  {'part':28s} {'measured ms':>12s} {'planned ms':>11s} {'error':>8s}  {'verdict':40s} "
             f"{'calib. ms':>9s} {'model ms':>8s}"]
    blk = blocked_row(result, tol, floor)
    for k, m, p, err, how, ok in rows + [blk]:
        note = ("waiting and every comm as one" if k == BLOCKED else "not modelled" if UNMODELLED in k else
                f"relative, tolerance {tol:.0%}" if how == "rel" else f"both < {floor:.0%} of the step")
        e = "" if err is None else ("inf" if err == float("inf") else f"{err:+.0%}")
        c, mo = (blocked(tiny), blocked(model)) if k == BLOCKED else (tiny.get(k, 0.0), model.get(k, 0.0))
        lines.append(f"  {k:28s} {m * 1e3:12.3f} {p * 1e3:11.3f} {e:>8s}  {('ok' if ok else 'MISS') + f' ({note})':40s} "
                     f"{c * 1e3:9.3f} {mo * 1e3:8.3f}")
    if result.get("others_runnable") is not None:
        lines.append(f"  other runnable tasks beside the job (median, sampled each step): {result['others_runnable']:g}")
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


__all__ = ["side_by_side", "blocked", "blocked_row", "held_rows", "counts_agree", "render"]
