"""Pictures of a pipeline step: one row per stage, time to the right.

Both drawings read the same data: per rank a list of ``(Instr, start, end)``
for its FORWARD/BACKWARD computes -- the *planned* timeline from
``simulate.simulate(schedule)`` (unit costs t_f = 1, t_b = 2) or the *measured*
one from ``PipelineParallel.timeline`` gathered with ``gather_timeline``
(seconds, clocks aligned at a barrier). Anything else in a row (waits for a
message, idle) is the bubble and is drawn empty.

    print(ascii_timeline(simulate(one_f_one_b(4, 8))))
    stage 0 |F0 F1 F2 F3 ......B0    F4 B1    F5 ...
    plot_timeline([planned, measured], ["planned", "measured"], "pp.png")  # needs matplotlib
"""
from pdist.parallel.pipeline.schedules import BACKWARD, COMPUTE, FORWARD
from pdist.parallel.pipeline.simulate import bubble_fraction

FILL = {FORWARD: "-", BACKWARD: "="}


def label(ins, v=1):
    """'F3' / 'B3'; with v > 1 chunks the chunk as a letter: 'F3a', 'B3b'."""
    return f"{ins.op[0]}{ins.mb}" + (chr(ord("a") + ins.chunk) if v > 1 else "")


def _computes(spans):
    return [[(i, s, e) for i, s, e in rank if i.op in COMPUTE] for rank in spans]


def ascii_timeline(spans, width=None, cols_per_unit=None, legend=True):
    """Text picture of a timeline. Planned timelines (unit costs) get
    ``cols_per_unit`` columns per t_f (default: wide enough for the labels);
    measured ones are scaled to ``width`` columns (default 100)."""
    spans = _computes(spans)
    v = 1 + max((i.chunk for r in spans for i, _, _ in r), default=0)
    end = max((e for r in spans for _, _, e in r), default=0.0) or 1.0
    if cols_per_unit is None:
        cols_per_unit = (4 if v > 1 else 3) if width is None else None
    scale = cols_per_unit if cols_per_unit else (width or 100) / end
    ncols = max(1, round(end * scale))
    idle = bubble_fraction(spans) if any(spans) else [0.0] * len(spans)
    lines = []
    for s, rank in enumerate(spans):
        row = ["."] * ncols
        for ins, t0, t1 in rank:
            c0 = min(ncols - 1, round(t0 * scale))
            c1 = max(c0 + 1, min(ncols, round(t1 * scale)))
            text = label(ins, v)
            for c in range(c0, c1):
                row[c] = text[c - c0] if c - c0 < len(text) and c1 - c0 > len(text) - 1 else FILL[ins.op]
        lines.append(f"stage {s} |{''.join(row)}| idle {idle[s]:5.1%}")
    if legend:
        lines.append(f"{'':8}F<mb> forward ('-'), B<mb> backward ('='), '.' idle"
                     + ("; letter = model chunk" if v > 1 else ""))
    return "\n".join(lines)


def plot_timeline(timelines, titles, path, unit="t_f"):
    """PNG of one or more timelines (e.g. planned above measured), one subplot each.
    Needs matplotlib (``pip install 'pdist[plots]'``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plot_timeline needs matplotlib: pip install 'pdist[plots]'") from e
    units = unit if isinstance(unit, (list, tuple)) else [unit] * len(timelines)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.2 + 0.5 * sum(len(t) for t in timelines)),
                             squeeze=False)
    colors = {FORWARD: "#4C72B0", BACKWARD: "#DD8452"}
    for ax, spans, title, u in zip(axes[:, 0], timelines, titles, units):
        spans = _computes(spans)
        v = 1 + max((i.chunk for r in spans for i, _, _ in r), default=0)
        end = max((e for r in spans for _, _, e in r), default=1.0)
        idle = bubble_fraction(spans)
        for s, rank in enumerate(spans):
            for ins, t0, t1 in rank:
                ax.broken_barh([(t0, t1 - t0)], (s - 0.4, 0.8), facecolors=colors[ins.op],
                               alpha=1.0 - 0.45 * ins.chunk / max(1, v - 1), edgecolor="white")
                if (t1 - t0) / end > 0.012 * len(label(ins, v)):
                    ax.text((t0 + t1) / 2, s, label(ins, v), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(spans)))
        ax.set_yticklabels([f"stage {s}\nidle {idle[s]:.0%}" for s in range(len(spans))], fontsize=8)
        ax.set_ylim(len(spans) - 0.5, -0.5)
        ax.set_xlim(0, end)
        ax.set_xlabel(u)
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
