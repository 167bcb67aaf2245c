"""The model, the layout and the optimizer of ``python -m pdist.train``, from its flags.

The layout flags map one to one onto the one shape (docs/design.md)::

    mesh  = DeviceMesh(dp=--dp, tp=--tp, pp=--pp, cp=--cp, ep=--ep)
    model = parallelize(GPT or Llama, mesh, zero_stage=--zero, sequence_parallel=--sp, schedule=--schedule,
                        microbatches=--microbatches, precision=--precision, context_parallel=--cp-impl)

The learning rate follows linear warm-up to ``--lr`` over ``--warmup`` steps, then a cosine to
``--min-lr`` at ``--steps`` (Loshchilov & Hutter, 2017), a function of the step alone, so a resumed
run takes the rates the uninterrupted run takes.
"""
import math
from types import SimpleNamespace

FIELDS = ("n_layer", "n_head", "n_embd", "block_size")


def pretrained(args):
    """--from-pretrained: the model (one process's copy), its sizes written into ``args``."""
    from pdist.checkpoint import from_pretrained
    from dataclasses import replace
    from pdist.models import registry
    model = from_pretrained(args.from_pretrained, dtype=args.dtype)
    if args.recompute != "none":            # read when the blocks are built: rebuild, same weights
        rebuilt = registry.build(replace(model.config, recompute=args.recompute), seed=0)
        rebuilt.load_state_dict(model.state_dict())
        model = rebuilt
    cfg = model.config
    for k in FIELDS:
        setattr(args, k, getattr(cfg, k))
    args.model = type(cfg).model_type
    return model


def config(args, vocab_size, model=None):
    """The model's config: the pretrained model's, or one from the size flags."""
    from pdist.models import registry
    if model is not None:
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"--from-pretrained {args.from_pretrained}: its vocabulary ({model.config.vocab_size}) "
                             f"is smaller than the data's ({vocab_size})")
        return model.config
    vocab_size = -(-vocab_size // args.pad_vocab) * args.pad_vocab
    kw = {k: getattr(args, k) for k in FIELDS}
    if args.model == "llama":
        kw["n_kv_head"] = args.n_kv_head
    if args.n_expert:
        kw["n_expert"] = args.n_expert
    return registry.config_class(args.model)(vocab_size=vocab_size, dtype=args.dtype, recompute=args.recompute,
                                             **kw)


def check(cfg, args):
    """parallelize's own checks (check_layout, check_context) on a mesh of the flags' sizes,
    before MPI starts: the same ValueError on every rank."""
    from pdist.parallel.context import check_context
    from pdist.parallel.parallelize import check_layout
    from pdist.parallel.pipeline.pipeline_parallel import default_chunks
    mesh = SimpleNamespace(dp_world_size=args.dp, tp_world_size=args.tp, pp_world_size=args.pp,
                           cp_world_size=args.cp, ep_world_size=args.ep)
    check_layout(cfg, mesh, args.zero, args.sp, args.schedule, args.microbatches, precision=args.precision)
    pipelined = args.pp > 1 or default_chunks(args.schedule, 1) > 1
    check_context(cfg, mesh, args.cp_impl if args.cp > 1 else None, args.precision, pipelined)


def model(cfg, args, loaded=None):
    """This rank's model of the one shape, and the mesh."""
    from pdist import comm
    from pdist.models import registry
    from pdist.parallel import parallelize
    mesh = comm.DeviceMesh(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    base = loaded if loaded is not None else registry.build(cfg, seed=args.seed)
    m = parallelize(base, mesh, zero_stage=args.zero, sequence_parallel=args.sp, schedule=args.schedule,
                    microbatches=args.microbatches, precision=args.precision,
                    context_parallel=args.cp_impl if args.cp > 1 else None)
    return m, mesh


def optimizer(model, args):
    from pdist.optim import AdamW
    return AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)


def lr_at(step, args):
    """Warm-up, then cosine: the rate of step ``step`` (0-based)."""
    warmup = min(args.warmup, args.steps)
    if warmup and step < warmup:
        return args.lr * (step + 1) / warmup
    if args.lr_schedule == "constant":
        return args.lr
    t = min(1.0, (step - warmup) / max(1, args.steps - warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))


def set_lr(opt, lr):
    for g in opt.param_groups:
        g["lr"] = lr


def describe(cfg, args):
    """One line: the model and the layout."""
    lay = f"dp {args.dp}" + "".join(f" x {k} {getattr(args, k)}" for k in ("cp", "tp", "pp") if getattr(args, k) > 1)
    more = [f"ZeRO-{args.zero}"] if args.zero else []
    more += ["sp"] if args.sp else []
    more += [f"{args.schedule}, m={args.microbatches}"] if args.pp > 1 else (
        [f"{args.microbatches} micro-batches"] if args.microbatches > 1 else [])
    more += [f"ep {args.ep}"] if args.ep > 1 else []
    more += [args.precision] if args.precision != "fp32" else []
    more += [f"recompute {args.recompute}"] if args.recompute != "none" else []
    return (f"{type(cfg).model_type} Ψ = {cfg.num_params():,} (L={cfg.n_layer}, h={cfg.n_head}, C={cfg.n_embd}, "
            f"T={cfg.block_size}, V={cfg.vocab_size}, {cfg.dtype}); {lay}" + (f" ({', '.join(more)})" if more else ""))
