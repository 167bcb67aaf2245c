"""Small helpers every lesson shares: the standard flags, printing on rank 0,
tables, the JSON summary (a contract, see docs/design.md; written by summary.py) and the PASS/FAIL line.

    args = lesson.parse_args(__doc__, extra=lambda p: p.add_argument("--stage", type=int))
    ...
    lesson.finish("03_zero", passed, runs, args, rank=rank, world_size=n)
"""
import argparse
import json
import sys

from pdist.course.summary import cannot_create_in, json_path_problem, write_json_atomic


TIMEOUT = 120     # s: a lesson's collectives wait this long at most (PDIST_TIMEOUT, when set, wins)
MODEL_DEFAULTS = dict(n_layer=2, n_head=4, n_embd=64, block_size=32)


def parser(doc=None, steps=20, seed=0, dtype="float32", batch_size=16, precision=False, models=False,
           no_inject=None, **model):
    """An ArgumentParser with the flags every training lesson accepts: --steps --seed
    --dtype --json --inject --trace, and the model and batch size (--n-layer --n-head
    --n-embd --block-size --batch-size; ``model`` overrides the lesson's defaults;
    ``models=True``: --model gpt2|llama too). ``no_inject``: why this lesson cannot inject
    faults (``validate`` then rejects --inject with that reason). Call
    ``validate(p, p.parse_args())`` right after parsing."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.no_inject = no_inject
    if models:
        p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2",
                       help="GPT-2, or Llama (RMSNorm, SwiGLU, RoPE, n_head / 2 kv heads; default %(default)s)")
        p.add_argument("--n-kv-head", type=int, default=None,
                       help="Llama's key/value heads (default: n_head / 2 when n_head is even, else n_head)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=seed, help="seed for weights and batches")
    p.add_argument("--dtype", choices=["float32", "float64"], default=dtype)
    if precision:
        p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                       help="parameters and gradients in bf16/fp16 with fp32 master weights "
                            "(docs/mixed_precision.md); --dtype is then the compute dtype")
    p.add_argument("--json", metavar="PATH", default=None, help="write the JSON summary here (rank 0)")
    sizes = dict(MODEL_DEFAULTS, **model)
    for k, v in sizes.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"GPT {k} (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=batch_size, help="global batch in rows (default %(default)s)")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation per block (docs/recompute.md; default %(default)s)")
    p.add_argument("--inject", metavar="FAULT", action="append", default=None,
                   help="inject a fault for teaching (pdist/faults/inject.py), e.g. straggler:rank=2,slowdown=1.5; "
                        "uneven-shard:rank=1,extra=0.3; slow-link:ranks=0-1,gbps=1; skip-collective:rank=3,step=5; "
                        "exception:rank=1,step=4; exit:rank=1,step=4; nan:rank=0,step=3 (repeatable)")
    p.add_argument("--trace", metavar="PATH", default=None,
                   help="write one Chrome/Perfetto trace merged over ranks here (open at https://ui.perfetto.dev)")
    p.add_argument("--waterfall", nargs="?", const="6N+12LhT", default=None, choices=["6N", "6N+12LhT", "causal"],
                   help="print each step's parts per rank at the end, MFU under this FLOP convention "
                        "(default 6N+12LhT; pdist/measure/waterfall.py)")
    return p


def start(args):
    """After the flags are parsed and validated, what every training lesson does first:
    the default dtype, the world (collectives wait at most TIMEOUT), the corpus.
    Returns (world, tokens, tokenizer). ``--inject`` faults are activated here (every
    rank parses the same flags: a bad spec exits on every rank before any collective);
    ``--trace`` turns on the detailed trace (waits and step phases) for ``finish``."""
    from pdist import comm, data
    from pdist.faults import inject
    from pdist.measure import trace
    from pdist.engine.backend import set_default_dtype
    faults = getattr(args, "inject", None)
    if faults:
        try:
            inject.parse(faults)
        except ValueError as e:
            sys.exit(f"error: {e}")
    if getattr(args, "trace", None):
        trace.set_detail(True)
    if getattr(args, "waterfall", None):
        from pdist.measure import waterfall
        args.waterfall_recorder = waterfall.Waterfall(convention=args.waterfall, auto=True)
    set_default_dtype(args.dtype)
    world = comm.init(timeout=TIMEOUT)
    if faults:
        try:                      # a rank or step that does not exist: a usage error on every rank
            inject.set(faults, steps=getattr(args, "steps", None))
        except ValueError as e:
            print(f"usage error (rank {world.rank}): {e}", file=sys.stderr, flush=True)
            sys.exit(2)
    tokens, tok = data.char_dataset()
    return world, tokens, tok


def config_from_args(args, vocab_size):
    """The lesson's GPTConfig (LlamaConfig with ``--model llama``) from the flags of ``parser()``."""
    kv = {"n_kv_head": args.n_kv_head} if getattr(args, "n_kv_head", None) else {}
    return gpt_config(vocab_size, dtype=args.dtype, model=getattr(args, "model", "gpt2"),
                      recompute=getattr(args, "recompute", "none"), **{k: getattr(args, k) for k in MODEL_DEFAULTS}, **kv)


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
    """Write the JSON summary (rank 0), print the PASS/FAIL line, exit non-zero on FAIL.

    The summary (``--json PATH``) is written atomically -- a temporary file in the
    same directory, flushed and fsync'ed, then ``os.replace``d over PATH -- so a
    reader never sees half a file, and as strict JSON (``allow_nan=False``): NaN
    and +-Infinity floats, at any depth, are written as ``null`` (a diverged loss
    is ``null`` in the file, never the non-standard ``NaN`` token)."""
    check = "PASS" if passed else "FAIL"
    wf = getattr(args, "waterfall_recorder", None) if args is not None else None
    if wf is not None:                      # --waterfall: collective, before the trace (which holds it)
        text = wf.table()
        if rank == 0:
            print("\n" + text, flush=True)
    if args is not None and getattr(args, "trace", None):
        write_trace(args.trace)
    if rank == 0:
        if args is not None and getattr(args, "json", None):
            summary = {"lesson": name, "world_size": world_size, "check": check, "runs": runs}
            write_json_atomic(args.json, summary)
        print(f"{check}: {name} {detail}".rstrip())
        sys.stdout.flush()
    if not passed:
        sys.exit(1)


def write_trace(path):
    """``--trace PATH``: one Chrome/Perfetto JSON merged over the world's ranks (collective:
    every rank calls it, as every rank calls ``finish``); one process alone writes its own."""
    from pdist import comm
    from pdist.measure import trace
    if comm.is_initialized():
        trace.write_chrome_trace(path, comm.get_world())
    else:
        with open(path, "w") as f:
            json.dump({"traceEvents": trace.chrome_events(trace.events(), 0, min(
                [e["start"] for e in trace.events()] or [0.0])), "displayTimeUnit": "ms"}, f)


# --- the shared training setup of every lesson (so every lesson's baseline is the same) ---------
LR, BETAS, EPS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 1e-8, 0.1


def gpt_config(vocab_size, dtype="float32", model="gpt2", **overrides):
    """The lessons' small GPT: 2 layers, 4 heads, 64 wide, 32 tokens of context (``model="llama"``:
    a Llama of these sizes, n_head / 2 kv heads when n_head is even)."""
    from pdist.models import registry
    kw = dict(vocab_size=vocab_size, dtype=dtype, **MODEL_DEFAULTS)
    kw.update(overrides)
    if model == "llama":
        kw.setdefault("n_kv_head", kw["n_head"] // 2 if kw["n_head"] % 2 == 0 else kw["n_head"])
    return registry.config_class(model)(**kw)


def make_adamw(params):
    """AdamW with the lessons' hyper-parameters (lr 3e-3, betas (0.9, 0.95), wd 0.1)."""
    from pdist.optim import AdamW
    return AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def train_reference(cfg, seed, steps, batch_size, tokens=None, precision="fp32", microbatches=1):
    """Single-process training, the baseline every strategy must equal, through the one
    loop (pdist.training.train): returns (losses per step, final state_dict).
    Batches: data.get_batch(tokens, B, T, seed, step). ``precision`` bf16/fp16: the
    fp32 masters' state_dict; with ``microbatches`` = N it is what data parallelism over
    N ranks equals bit for bit (the same rounding points: pdist/engine/precision.py)."""
    from pdist import data
    from pdist.models import registry
    from pdist.parallel.base import Local
    from pdist.parallel.mixed_precision import MixedPrecision
    from pdist.engine.precision import cast_module
    from pdist.training import train
    if tokens is None:
        tokens, _ = data.char_dataset()
    model = Local(cast_module(registry.build(cfg, seed=seed), precision), microbatches)
    if precision != "fp32":
        model = MixedPrecision(model, precision)
    opt = make_adamw(model.parameters())
    losses = train(model, opt, data.batch_fn(tokens, batch_size, cfg.block_size, seed), steps)
    return losses, (model.module.state_dict() if precision == "fp32" else model.full_state_dict())


POSITIVE_INT_FLAGS = ("steps", "batch_size", "micro_batches", "accum", "microbatches", "n_layer", "n_head",
                      "n_embd", "block_size", "n_kv_head")
NON_NEGATIVE_INT_FLAGS = ("seed",)


def validate(parser, args):
    """Reject bad flags before any training or collective, with argparse's usage
    message and exit code 2 (``parser.error``). Every rank parses the same command
    line, so every rank stops here, and none is left waiting in a collective.

    Generic: checks only the attributes ``args`` has (``None`` means "default",
    skipped): ``steps``, ``batch_size``, ``micro_batches``, ``n_layer``, ``n_head``,
    ``n_embd``, ``block_size`` >= 1; ``seed`` >= 0; ``n_embd`` divisible by
    ``n_head``; ``json``: its directory exists and a file can be created there
    (checked by creating and removing a temporary file, which also catches
    read-only file systems and runs as root). Returns ``args``."""
    def flag(attr):
        return "--" + attr.replace("_", "-")
    for attr in POSITIVE_INT_FLAGS:
        v = getattr(args, attr, None)
        if v is not None and v < 1:
            parser.error(f"{flag(attr)} must be >= 1, got {v}")
    for attr in NON_NEGATIVE_INT_FLAGS:
        v = getattr(args, attr, None)
        if v is not None and v < 0:
            parser.error(f"{flag(attr)} must be >= 0, got {v}")
    n_embd, n_head = getattr(args, "n_embd", None), getattr(args, "n_head", None)
    if n_embd is not None and n_head is not None and n_embd % n_head:
        parser.error(f"--n-embd ({n_embd}) must be divisible by --n-head ({n_head})")
    if getattr(args, "model", None) == "llama" and n_embd and n_head and (n_embd // n_head) % 2:
        parser.error(f"--model llama needs an even head size (RoPE): --n-embd / --n-head = {n_embd // n_head}")
    for attr in ("json", "trace"):          # both written at the end: checked before any work
        path = getattr(args, attr, None)
        problem = json_path_problem(path) if path else None
        if problem:
            parser.error(f"--{attr} {path}: {problem}")
    _validate_inject(parser, args)
    return args


def _validate_inject(parser, args):
    """--inject: this lesson takes faults, their syntax, and their steps against --steps (the
    ranks are checked against the world in ``start``, once it is known)."""
    faults = getattr(args, "inject", None)
    if not faults:
        return
    if getattr(parser, "no_inject", None):
        parser.error(f"--inject {' '.join(faults)}: {parser.no_inject}")
    from pdist.faults import inject
    try:
        parsed = inject.parse(faults)
        steps = getattr(args, "steps", None)
        if steps is not None:
            inject.check(parsed, world_size=None, steps=steps)
    except ValueError as e:
        parser.error(str(e))


def dir_problem(path):
    """Why ``path`` cannot hold the files a lesson writes there, or None: an existing path
    must be a writable directory; a new one needs a writable parent (it is created)."""
    import os
    target = path if os.path.exists(path) else os.path.dirname(os.path.abspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a directory"
    if not os.path.isdir(target):
        return f"its parent directory {target} does not exist"
    return cannot_create_in(target)


def warn_shared_cores(world):
    """One line on rank 0 when the ranks on this node outnumber its cores: every timing
    the lesson prints is then a shared-core timing (ranks take turns on a core, so
    ms/step and idle time grow with the ranks, not with the algorithm). Returns True
    when it warned. Call it right after ``start(args)`` / ``comm.init()``."""
    from pdist.comm.mpi import local_size, node_cores
    ranks, cores = local_size(), node_cores()          # the union of the node's masks: binding is not sharing
    if ranks <= cores:
        return False
    if world.rank == 0:
        print(f"note: {ranks} ranks share {cores} cores on this node: shared-core timings below "
              f"(the checks are unaffected)", flush=True)
    return True
