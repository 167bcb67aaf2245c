"""``--plot``: ``loss.png`` (training and eval loss per step, from log.jsonl) and, when
pdist.measure.waterfall is there, ``waterfall.png`` (rank 0's mean step as its parts) in ``--out``,
with the waterfall's table (every rank) printed. Each PNG is written to a temporary name in
the same directory and renamed into place (a reader never sees half a file). Without matplotlib,
a line says so and the run still succeeds."""
import json
import os


def read_log(path):
    """(train [(step, loss)], eval [(step, loss)]) of the log's last run segment onwards, all of them."""
    train, evals = {}, {}
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("loss") is not None and "step" in r:
                train[r["step"]] = r["loss"]
            if r.get("eval_loss") is not None:
                evals[r["step"]] = r["eval_loss"]
    return sorted(train.items()), sorted(evals.items())


def _atomic_png(fig, path):
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)


def write(out, log_path, say=print, summary=None):
    """The plots (``summary``: the waterfall's, or None); ``say`` gets one line per file (or why none)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("--plot: matplotlib is not installed (pip install matplotlib): no plots written")
        return []
    train, evals = read_log(log_path)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "loss.png")
    _atomic_png(fig, path)
    plt.close(fig)
    say(f"--plot: wrote {path}")
    return [path] + (waterfall(out, summary, say) if summary else [])


def start_waterfall(model, say=print):
    """pdist.measure.waterfall's ``Waterfall(model, auto=True)`` (every step's parts, per rank), or
    None when this pdist has none yet (imported here, only with --plot)."""
    try:
        from pdist.measure.waterfall import Waterfall
    except ImportError:
        say("--plot: no waterfall yet (pdist.measure.waterfall is not in this pdist): loss.png only")
        return None
    return Waterfall(model, auto=True)


def waterfall(out, summary, say=print):
    """waterfall.png: this rank's mean step (``Waterfall.summary()``) as a waterfall, one bar per
    part (ms/step) starting where the one before ended, the measured step beside them."""
    import matplotlib.pyplot as plt
    label, run = next(iter(summary.items()))
    parts = [(k, 1e3 * v) for k, v in run["parts"].items() if v > 0]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(parts) + 1.5))
    left = 0.0
    for i, (name, ms) in enumerate(parts):
        ax.barh(i, ms, left=left)
        ax.text(left + ms, i, f" {ms:.2f}", va="center", fontsize=8)
        left += ms
    ax.barh(len(parts), 1e3 * run["step_s"], color="0.4")
    ax.set_yticks(range(len(parts) + 1), [n for n, _ in parts] + ["measured step"])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (rank 0, mean over %d steps)" % run["steps"])
    ax.set_title(label, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out, "waterfall.png")
    _atomic_png(fig, path)
    plt.close(fig)
    say(f"--plot: wrote {path}")
    return [path]
