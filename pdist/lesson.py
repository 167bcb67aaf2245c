"""Small helpers every lesson shares: the standard flags, printing on rank 0,
tables, the JSON summary (a contract, see DESIGN.md) and the PASS/FAIL line.

    args = lesson.parse_args(__doc__, extra=lambda p: p.add_argument("--stage", type=int))
    ...
    lesson.finish("03_zero", passed, runs, args, rank=rank, world_size=n)
"""
import argparse
import json
import sys


def parser(doc=None, steps=20, seed=0, dtype="float32"):
    """An ArgumentParser with the flags every training lesson accepts."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=seed, help="seed for weights and batches")
    p.add_argument("--dtype", choices=["float32", "float64"], default=dtype)
    p.add_argument("--json", metavar="PATH", default=None, help="write the JSON summary here (rank 0)")
    return p


def table(rows, headers, floatfmt="{:.4g}"):
    """Format a list of rows as an aligned text table (returns the string)."""
    def fmt(v):
        if isinstance(v, float):
            return floatfmt.format(v)
        return str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([line, sep, *body])


def fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def finish(name, passed, runs, args, rank=0, world_size=1, detail=""):
    """Write the JSON summary (rank 0), print the PASS/FAIL line, exit non-zero on FAIL."""
    check = "PASS" if passed else "FAIL"
    if rank == 0:
        if args is not None and getattr(args, "json", None):
            summary = {"lesson": name, "world_size": world_size, "check": check, "runs": runs}
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1, default=_jsonable)
        print(f"{check}: {name} {detail}".rstrip())
        sys.stdout.flush()
    if not passed:
        sys.exit(1)


def _jsonable(v):
    try:
        import numpy as np
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            return v.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(v)}")


# --- the shared training setup of every lesson (so every lesson's baseline is the same) ---------
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1


def gpt_config(vocab_size, dtype="float32", **overrides):
    """The lessons' small GPT: 2 layers, 4 heads, 64 wide, 32 tokens of context."""
    from pdist.gpt import GPTConfig
    kw = dict(vocab_size=vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64, dtype=dtype)
    kw.update(overrides)
    return GPTConfig(**kw)


def make_adamw(params):
    """AdamW with the lessons' hyper-parameters (lr 3e-3, betas (0.9, 0.95), wd 0.1)."""
    from pdist.optim import AdamW
    return AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def train_reference(cfg, seed, steps, batch_size, tokens=None):
    """Single-process training, the baseline every strategy must equal:
    returns (losses per step, final state_dict). Batches: data.get_batch(tokens, B, T, seed, step)."""
    from pdist import data, gpt
    if tokens is None:
        tokens, _ = data.char_dataset()
    model = gpt.GPT(cfg, seed=seed)
    opt = make_adamw(model.parameters())
    losses = []
    for step in range(steps):
        x, y = data.get_batch(tokens, batch_size, cfg.block_size, seed, step)
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()
