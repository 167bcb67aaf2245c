"""The flags of ``python -m pdist.train``, a config file that holds the same flags, and every check
that can be made before any work.

    python -m pdist.train --config run.toml --steps 200      # the command line wins over the file

A config file (``.toml`` or ``.json``) is a table of flags by their long names (``n_layer`` or
``n-layer``), ``true``/``false`` for the on/off flags. Its values go through the same parser as the
command line, placed before it, so every value is checked the same way and the command line wins.
Every bad input is an argparse error (exit 2, the flag named) on every rank, before MPI starts:
every rank parses the same command line and reads the world size the launcher claims
(pdist/launcher.py), so all of them stop here together.
"""
import argparse
import json
import os
import sys

from pdist.course.summary import cannot_create_in

SIZES = dict(n_layer=2, n_head=4, n_embd=64, block_size=32)    # the default model (about a minute on 2 cores)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
TOKEN_SUFFIXES = (".npy", ".bin")


def parser():
    p = argparse.ArgumentParser(prog="python -m pdist.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--config", metavar="FILE", default=None, help="a .toml or .json file of flags (the command line wins)")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="FILE", default=None,
                   help="a text file (one token per character) or a token file (.npy, or .bin of --token-dtype); "
                        "default: the bundled corpus (pdist/corpus.txt)")
    g.add_argument("--token-dtype", choices=["uint16", "int32"], default="uint16", help="the ids of a .bin file")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="a token file's vocabulary (default: its largest id + 1)")
    g.add_argument("--pad-vocab", type=int, default=8,
                   help="round the vocabulary up to a multiple of N, so that --tp divides it (Megatron's "
                        "--make-vocab-size-divisible-by); the extra ids never occur")
    g.add_argument("--val-fraction", type=float, default=0.1, help="the held-out tail of the tokens")
    g.add_argument("--eval-every", type=int, default=50, help="eval loss every N steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=2, help="held-out batches per eval")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["gpt2", "llama"], default="gpt2", help="the architecture")
    g.add_argument("--from-pretrained", metavar="DIR", default=None,
                   help="start from a Hugging Face directory (config.json + safetensors); size flags must be unset")
    for k, v in SIZES.items():
        g.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"{k} (default {v})")
    g.add_argument("--n-kv-head", type=int, default=None, help="Llama's key/value heads (default n_head / 2)")
    g.add_argument("--n-expert", type=int, default=0, help="mixture-of-experts MLP with E experts (0: dense)")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="parameters' dtype")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    _layout(p.add_argument_group("layout (world = dp x cp x tp x pp)"))
    _training(p.add_argument_group("training"))
    return p


def _layout(g):
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (cp tp pp))")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (Megatron)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size")
    g.add_argument("--cp-impl", choices=["ring", "ring-zigzag", "ulysses"], default="ring",
                   help="context parallelism's attention")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides dp; needs --n-expert)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage over dp")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=False,
                   help="sequence parallelism with tp")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="the pipeline schedule")
    g.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (pipeline or accumulation)")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16/fp16 weights and gradients with fp32 masters")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation per block")
    g.add_argument("--device", choices=["cpu", "gpu"], default=None, help="default: PDIST_DEVICE (else cpu)")


def _training(g):
    g.add_argument("--steps", type=int, default=300, help="optimizer steps in all (a resumed run ends there too)")
    g.add_argument("--batch-size", type=int, default=16, help="global batch in rows")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    g.add_argument("--min-lr", type=float, default=3e-4, help="the cosine schedule's final learning rate")
    g.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine",
                   help="after the warm-up: cosine to --min-lr at --steps, or --lr throughout")
    g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (at most --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    g.add_argument("--out", metavar="DIR", default="runs/train", help="checkpoints (ckpt/), log.jsonl, plots")
    g.add_argument("--save-every", type=int, default=100, help="save every N steps (0: only at the end)")
    g.add_argument("--keep", type=int, default=3, help="keep the newest K checkpoints of the run")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=False,
                   help="continue from the newest complete checkpoint in --out (any layout)")
    g.add_argument("--log-every", type=int, default=10, help="a progress line every N steps when not a terminal")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="per-rank peak for MFU (default: this rank's measured GEMM rate)")
    g.add_argument("--plot", action=argparse.BooleanOptionalAction, default=False,
                   help="write loss.png (and waterfall.png) into --out at the end (matplotlib)")


def read_config(p, path):
    """The config file as argv (placed before the command line: later flags win)."""
    if not os.path.isfile(path):
        p.error(f"--config {path}: no such file")
    try:
        if path.endswith(".toml"):
            with open(path, "rb") as f:
                table = _toml().load(f)
        elif path.endswith(".json"):
            with open(path) as f:
                table = json.load(f)
        else:
            p.error(f"--config {path}: want a .toml or .json file")
    except (ValueError, OSError) as e:
        p.error(f"--config {path}: {e}")
    if not isinstance(table, dict):
        p.error(f"--config {path}: want a table of flags, got {type(table).__name__}")
    actions = {a.dest: a for a in p._actions if a.option_strings}
    argv = []
    for key, v in table.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest in ("config", "help"):
            p.error(f"--config {path}: unknown key {key!r} (keys are the flags' names, e.g. n_layer = 2)")
        flag = "--" + dest.replace("_", "-")
        if isinstance(actions[dest], argparse.BooleanOptionalAction):
            if not isinstance(v, bool):
                p.error(f"--config {path}: {key} = {v!r} must be true or false")
            argv.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, (dict, list, bool)) or v is None:
            p.error(f"--config {path}: {key} = {v!r} must be a number or a string")
        else:
            argv += [flag, str(v)]
    return argv


def _toml():
    try:
        import tomllib                     # Python 3.11+
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError("reading TOML needs Python 3.11 or `pip install tomli`; or write the flags as "
                             ".json") from None
    return tomllib


def world_size():
    """The world size the launcher claims (1 without one): known before MPI starts."""
    from pdist.launcher import claims
    return next((size for _, _, size, _ in claims() if size), 1)


def parse(argv=None, world=None):
    """The checked flags (argparse.Namespace), ``dp`` and the model sizes filled in."""
    p = parser()
    first = p.parse_known_args(argv)[0]
    pre = read_config(p, first.config) if first.config else []
    args = p.parse_args(pre + list(argv if argv is not None else sys.argv[1:]))
    check(p, args, world_size() if world is None else world)
    return args


POSITIVE = ("steps", "batch_size", "n_layer", "n_head", "n_embd", "block_size", "n_kv_head", "vocab_size", "tp",
            "pp", "cp", "ep", "dp", "microbatches", "pad_vocab", "eval_batches", "keep", "log_every")
NON_NEGATIVE = ("seed", "eval_every", "save_every", "warmup", "n_expert")


def check(p, args, world):
    """Every check that needs no MPI and no model: ranges, files, the world's factors."""
    for k in POSITIVE + NON_NEGATIVE:
        v = getattr(args, k)
        if v is not None and v < (1 if k in POSITIVE else 0):
            p.error(f"--{k.replace('_', '-')} must be >= {1 if k in POSITIVE else 0}, got {v}")
    for k in ("lr", "min_lr", "weight_decay", "peak_tflops"):
        v = getattr(args, k)
        if v is not None and not (v >= 0 and v < float("inf")) or (k in ("lr", "peak_tflops") and v == 0):
            p.error(f"--{k.replace('_', '-')} must be a finite number {'> 0' if k in ('lr', 'peak_tflops') else '>= 0'}, "
                    f"got {v}")
    if args.min_lr > args.lr:
        p.error(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    _check_files(p, args)
    _check_model(p, args)
    _check_world(p, args, world)
    return args


def _check_files(p, args):
    if args.data is not None and not os.path.isfile(args.data):
        p.error(f"--data {args.data}: no such file")
    if args.data is None and args.vocab_size is not None:
        p.error("--vocab-size is for a token file (--data F.npy or F.bin); the bundled corpus has its own")
    if args.from_pretrained is not None and not os.path.isfile(os.path.join(args.from_pretrained, "config.json")):
        p.error(f"--from-pretrained {args.from_pretrained}: not a Hugging Face directory (no config.json)")
    problem = out_problem(args.out)
    if problem:
        p.error(f"--out {args.out}: {problem}")
    if args.resume:
        from pdist.checkpoint import latest
        ckpt = os.path.join(args.out, "ckpt")
        if not os.path.isdir(ckpt) or latest(ckpt) is None:
            p.error(f"--resume: no complete checkpoint under {ckpt} (train without --resume first, "
                    f"or point --out at the run)")


def out_problem(path):
    """Why ``path`` cannot become the run's directory (created with its parents), or None."""
    if os.path.exists(path):
        return None if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK) else \
            "exists and is not a writable directory"
    up = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(up):
        up = os.path.dirname(up)
    return f"{up} is not a directory" if not os.path.isdir(up) else cannot_create_in(up)


def _check_model(p, args):
    given = [k for k in SIZES if getattr(args, k) is not None] + (["n_kv_head"] if args.n_kv_head else [])
    if args.from_pretrained is not None:
        if given:
            p.error(f"--from-pretrained takes the sizes from its config.json: drop --{given[0].replace('_', '-')}")
        return
    for k, v in SIZES.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.n_embd % args.n_head:
        p.error(f"--n-embd ({args.n_embd}) must be divisible by --n-head ({args.n_head})")
    if args.model == "llama":
        if (args.n_embd // args.n_head) % 2:
            p.error(f"--model llama needs an even head size (RoPE): --n-embd / --n-head = {args.n_embd // args.n_head}")
        if args.n_kv_head is None:
            args.n_kv_head = args.n_head // 2 if args.n_head % 2 == 0 else args.n_head
        if args.n_head % args.n_kv_head:
            p.error(f"--n-kv-head ({args.n_kv_head}) must divide --n-head ({args.n_head})")
    elif args.n_kv_head is not None:
        p.error("--n-kv-head is Llama's (--model llama)")


def _check_world(p, args, world):
    rest = args.tp * args.pp * args.cp
    if args.dp is None:
        if world % rest:
            p.error(f"--tp {args.tp} x --pp {args.pp} x --cp {args.cp} = {rest} does not divide the world ({world} "
                    f"ranks): launch with mpirun -n a multiple of {rest}")
        args.dp = world // rest
    if args.dp * rest != world:
        p.error(f"--dp {args.dp} x --cp {args.cp} x --tp {args.tp} x --pp {args.pp} = {args.dp * rest}, but the "
                f"world has {world} rank(s): launch with mpirun -n {args.dp * rest} or change the sizes")
    if args.batch_size % (args.dp * args.microbatches):
        p.error(f"--batch-size {args.batch_size} must divide by --dp x --microbatches = {args.dp * args.microbatches}")
    if args.ep > 1 and (args.dp % args.ep or not args.n_expert):
        p.error(f"--ep {args.ep} needs --n-expert > 0 and must divide --dp ({args.dp})")
    if args.sp and args.tp == 1:
        p.error("--sp (sequence parallelism) needs --tp > 1")
