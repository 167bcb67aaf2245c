"""The waterfall's summary (per run, means over steps) and its text table (pdist/measure/waterfall.py).

``summary(records, skip)``: {run label: {"parts": {part: s}, "step_s", "sum_s", "mfu":
{convention: fraction}, "steps", "rate"}} of one rank, plain numbers (JSON- and pickle-safe).
``render(per_rank, convention)``: per run, a row per part and a column per rank (ms/step),
then the sum of the parts, the measured step, their ratio (the check: within 3%), and MFU
under every convention (the default marked with *).
"""
from pdist.measure import flops

CHECK = 0.03


def summary(records, skip=1):
    """Means per run over its resolved steps, the first ``skip`` dropped when more remain."""
    runs = {}
    for r in records:
        if r.get("resolved"):
            runs.setdefault(r["label"], []).append(r)
    out = {}
    for label, rs in runs.items():
        rs = rs[skip:] if len(rs) > skip else rs
        names = []
        for r in rs:
            names += [k for k in r["parts"] if k not in names]
        n = len(rs)
        parts = {k: sum(r["parts"].get(k, 0.0) for r in rs) / n for k in names}
        out[label] = {"parts": parts, "step_s": sum(r["step_s"] for r in rs) / n, "sum_s": sum(parts.values()),
                      "mfu": {c: sum(r["mfu"][c] for r in rs) / n for c in flops.CONVENTIONS},
                      "steps": n, "rate": rs[-1]["rate"]}
    return out


def _fmt_table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).rjust(w) if i else str(h).ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    body = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def render(per_rank, convention=flops.DEFAULT):
    """The text of every run's table (module doc); ``per_rank``: one ``summary`` per rank."""
    labels = []
    for s in per_rank:
        labels += [k for k in s if k not in labels]
    out = []
    for label in labels:
        cols = [s.get(label) for s in per_rank]
        have = [c for c in cols if c is not None]
        names = []
        for c in have:
            names += [k for k in c["parts"] if k not in names]
        rate = have[0]["rate"]
        rows = [[k] + [f"{c['parts'].get(k, 0.0) * 1e3:.2f}" if c else "-" for c in cols] for k in names]
        rows.append(["sum of parts"] + [f"{c['sum_s'] * 1e3:.2f}" if c else "-" for c in cols])
        rows.append(["measured step"] + [f"{c['step_s'] * 1e3:.2f}" if c else "-" for c in cols])
        rows.append(["sum / step"] + [f"{c['sum_s'] / max(c['step_s'], 1e-12):.3f}" if c else "-" for c in cols])
        for conv in flops.CONVENTIONS:
            mark = "*" if conv == convention else ""
            rows.append([f"MFU {conv}{mark}"] + [f"{c['mfu'][conv]:.1%}" if c else "-" for c in cols])
        ok = all(abs(c["sum_s"] - c["step_s"]) <= CHECK * c["step_s"] for c in have)
        steps = have[0]["steps"]
        out.append(f"waterfall: {label} (ms/step, mean of {steps} steps; GEMM rate {rate / 1e9:.2f} GFLOP/s "
                   f"(the ranks' best); * the default convention)\n"
                   + _fmt_table(rows, ["part"] + [f"rank {i}" for i in range(len(cols))])
                   + f"\nparts sum to the measured step within {CHECK:.0%} on every rank: {ok}")
    return "\n\n".join(out)


__all__ = ["summary", "render", "CHECK"]
