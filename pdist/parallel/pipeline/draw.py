"""Pictures of a pipeline step: one row per stage, time to the right.

Both drawings read the same data: per rank a list of ``(Instr, start, end)``
for its FORWARD/BACKWARD computes -- the *planned* timeline from
``simulate.simulate(schedule)`` (unit costs t_f = 1, t_b = 2) or the *measured*
one from ``PipelineParallel.timeline`` gathered with ``stats.gather_timeline``
(seconds, clocks aligned at a barrier). Anything else in a row (waits for a
message, idle) is the bubble and is drawn empty.

    print(ascii_timeline(simulate(one_f_one_b(4, 8))))
    stage 0 |F0 F1 F2 F3 ......B0    F4 B1    F5 ...
    plot_timeline([planned, measured], ["planned", "measured"], "pp.png")  # needs matplotlib
"""
from pdist.parallel.pipeline.schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD
from pdist.parallel.pipeline.simulate import bubble_fraction

FILL = {FORWARD: "-", BACKWARD: "=", BACKWARD_INPUT: "~", BACKWARD_WEIGHT: "+"}
LETTER = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}   # PyTorch's letters
COLORS = {FORWARD: "#4C72B0", BACKWARD: "#DD8452", BACKWARD_INPUT: "#C44E52", BACKWARD_WEIGHT: "#55A868"}
NAMES = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "input grads (the paper's B)",
         BACKWARD_WEIGHT: "weight grads"}


def label(ins, v=1):
    """'F3' forward, 'B3' whole backward, 'I3' its input-gradient half (the zero-bubble paper's
    B), 'W3' its weight half (torch.distributed.pipelining's letters); with v > 1 chunks the
    chunk as a letter: 'F3a', 'I3b'."""
    return f"{LETTER[ins.op]}{ins.mb}" + (chr(ord("a") + ins.chunk) if v > 1 else "")


def _legend(spans):
    """The legend line's entries for the ops that occur: "F<mb> forward ('-'), ..."."""
    ops = [op for op in COMPUTE if any(i.op == op for r in spans for i, _, _ in r)] or [FORWARD, BACKWARD]
    return ", ".join(f"{LETTER[op]}<mb> {NAMES[op]} ('{FILL[op]}')" for op in ops)


def _computes(spans):
    return [[(i, s, e) for i, s, e in rank if i.op in COMPUTE] for rank in spans]


def _draw_span(row, c0, c1, text, fill, clip):
    """Columns [c0, c1) of ``row``: the label then the fill. A span narrower than its label gets
    only the fill, or with ``clip`` as much of the label as fits ('F', 'B3' for 'B3b')."""
    shown = text if c1 - c0 >= len(text) else text[:c1 - c0] if clip else ""
    for c in range(c0, c1):
        row[c] = shown[c - c0] if c - c0 < len(shown) else fill


def time_axis(end, ncols, unit="ms", per_unit=1e3, indent=9):
    """Two lines under a measured timeline: a ruler with '+' at round times and the times in
    ``unit`` (seconds * ``per_unit``) starting at their column. ``end`` seconds span ``ncols``."""
    total = end * per_unit
    step = next((m * 10 ** k for k in range(-3, 7) for m in (1, 2, 5) if total / (m * 10 ** k) <= 8),
                total or 1.0)
    ticks = [i * step for i in range(int(total / step) + 1)]
    ruler, labels = ["-"] * (ncols + 1), [" "] * (ncols + 12)
    free = 0
    for t in ticks:
        c = min(ncols, round(t / total * ncols)) if total else 0
        ruler[c] = "+"
        text = f"{t:g}" + (f" {unit}" if t == ticks[-1] else "")
        if c >= free:
            labels[c:c + len(text)] = text
            free = c + len(text) + 1
    return (" " * indent + "".join(ruler) + "\n"
            + " " * indent + "".join(labels).rstrip())


def ascii_timeline(spans, width=None, cols_per_unit=None, legend=True, axis=None):
    """Text picture of a timeline, one row per stage. Planned timelines (unit costs) get
    ``cols_per_unit`` columns per t_f (default: wide enough for the labels); measured ones
    (seconds) are scaled to ``width`` columns (default 100), every span starts with as much
    of its label as fits, and ``axis="ms"`` adds a time axis aligned with the columns."""
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
            _draw_span(row, c0, c1, label(ins, v), FILL[ins.op], clip=not cols_per_unit)
        lines.append(f"stage {s} |{''.join(row)}| idle {idle[s]:5.1%}")
    if axis:
        lines.append(time_axis(end, ncols, unit=axis, per_unit={"s": 1, "ms": 1e3, "us": 1e6}[axis]))
    if legend:
        lines.append(f"{'':8}{_legend(spans)}, '.' idle"
                     + ("; letter = model chunk" if v > 1 else ""))
        if not cols_per_unit:
            lines.append(f"{'':8}one column = {end / ncols * 1e3:.2g} ms; a span narrower than its "
                         "label shows what fits (its letter alone: 'F', 'I')")
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
    for ax, spans, title, u in zip(axes[:, 0], timelines, titles, units):
        spans = _computes(spans)
        v = 1 + max((i.chunk for r in spans for i, _, _ in r), default=0)
        end = max((e for r in spans for _, _, e in r), default=1.0)
        idle = bubble_fraction(spans)
        for s, rank in enumerate(spans):
            for ins, t0, t1 in rank:
                ax.broken_barh([(t0, t1 - t0)], (s - 0.4, 0.8), facecolors=COLORS[ins.op],
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
