"""``--plot``: ``loss.png`` (training and eval loss per step, from log.jsonl) and ``waterfall.png``
when pdist.measure.waterfall is there, in ``--out``. Each PNG is written to a temporary name in
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


def write(out, log_path, say=print):
    """The plots; ``say`` gets one line per file (or why there is none)."""
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
    return [path] + waterfall(out, say)


def waterfall(out, say=print):
    """waterfall.png from pdist.measure.waterfall's ``plot(path)``, when it is there."""
    try:
        from pdist.measure import waterfall as wf
    except ImportError:
        say("--plot: no waterfall yet (pdist.measure.waterfall is not in this pdist)")
        return []
    if not hasattr(wf, "plot"):
        say("--plot: no waterfall yet (pdist.measure.waterfall has no plot())")
        return []
    path = os.path.join(out, "waterfall.png")
    wf.plot(path)
    say(f"--plot: wrote {path}")
    return [path]
