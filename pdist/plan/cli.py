"""``python -m pdist.plan``: memory per GPU and time per step of a layout, from formulas.

    python -m pdist.plan --model gpt3-175b --cluster a100 --dp 8 --tp 8 --pp 16 --sp \\
        --recompute selective --global-batch 1536
    python -m pdist.plan --model mixtral-8x7b --cluster h100 --dp 16 --ep 8 --zero 1 --global-batch 256
    python -m pdist.plan --n-layer 4 --n-head 4 --n-embd 64 --n-expert 8 --expert-top-k 2 --dp 4 --ep 4
    python -m pdist.plan --params 7.5e9 --dp 64 --zero 3 --accounting paper --json
    python -m pdist.plan --model gpt2-xl --cluster a100 --gpus 16 --global-batch 64 --search

The header states every assumption (peak, alpha, beta, the efficiency model, overlap, the byte
and memory accounting); the formulas are in pdist/plan/*.py and docs/planning.md. The planner
never imports MPI. ``--cluster this`` inside a launch on several nodes (a real cluster, or
the emulated one: ``python -m pdist.cluster -- python -m pdist.plan --cluster this ...``) plans
for those nodes, and only rank 0 prints (pdist/plan/here.py).
"""
import argparse
import json
from dataclasses import replace

from pdist.models.gpt import GPTConfig
from pdist.models.llama import LlamaConfig
from pdist.plan.arch import FLOP_CONVENTIONS, arch_of
from pdist.plan.here import this_cluster
from pdist.plan.layout import ACCOUNTING, CP_MODES, SCHEDULES, Layout
from pdist.plan.model import FIT_FRACTION
from pdist.plan.planner import plan, search
from pdist.plan.presets import BYTES, CLUSTERS, MODELS, Link
from pdist.plan.report import gib, header, png_chart, table, text_chart


class _Fmt(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _num(kind, low):
    def f(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a{'n integer' if kind is int else ' number'}")
        if not v >= low:
            raise argparse.ArgumentTypeError(f"{s!r} must be >= {low}")
        return v
    return f


POS, NONNEG, POSF = _num(int, 1), _num(int, 0), _num(float, 1e-12)


def _mla(s):
    try:
        v = tuple(int(x) for x in s.split(","))
    except ValueError:
        v = ()
    if len(v) != 5 or min(v) < 0 or min(v[1:]) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: give five integers q_rank,kv_rank,nope,rope,v (q_rank may be 0)")
    return v


def _arch_flags(m):
    """The model flags only an Arch holds (pdist/plan/arch.py)."""
    m.add_argument("--expert-ffn", type=POS, default=None, help="each routed expert's MLP width (default --ffn)")
    m.add_argument("--n-shared-experts", type=NONNEG, default=None, help="shared experts per MoE layer (DeepSeek)")
    m.add_argument("--n-dense-layers", type=NONNEG, default=None, help="first layers with a dense MLP (DeepSeek)")
    m.add_argument("--mlp", default=None, choices=["gelu", "swiglu"], help="two-matrix (GELU, squared ReLU) or "
                   "gated three-matrix MLP (default: the family's)")
    m.add_argument("--window", type=POS, default=None, help="sliding-window attention: keys per query (Mistral)")
    m.add_argument("--parallel-block", action="store_true", help="attention and MLP side by side from one norm "
                   "(GPT-J, PaLM, Falcon): half the tp all-reduces")
    m.add_argument("--mla", type=_mla, default=None, metavar="Q,KV,NOPE,ROPE,V", help="multi-head latent "
                   "attention ranks and head dims (DeepSeek-V2/V3: 1536,512,128,64,128; Q 0: no q compression)")


def _parser():
    p = argparse.ArgumentParser(prog="python -m pdist.plan", description=__doc__, formatter_class=_Fmt)
    m = p.add_argument_group("model (a preset, a size, or Ψ alone)")
    m.add_argument("--model", default="gpt2", choices=sorted(MODELS), help="a preset (pdist/plan/presets.py)")
    m.add_argument("--params", type=POSF, default=None, help="Ψ alone: model-state memory only")
    m.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"], help="the family of a --n-layer model")
    for k, d, h in (("n_layer", None, "layers: plan a model of this size (needs --n-head, --n-embd)"),
                    ("n_head", None, "attention heads"), ("n_embd", None, "width h"),
                    ("n_kv_head", None, "key/value heads (GQA; llama; default n_head)"),
                    ("ffn", None, "MLP width (default 4h GELU, 8h/3 SwiGLU)"),
                    ("vocab_size", 50257, "vocabulary"), ("seq_len", 0, "tokens per row (0: the model's)")):
        m.add_argument("--" + k.replace("_", "-"), type=NONNEG if k == "seq_len" else POS, default=d, help=h)
    m.add_argument("--n-expert", type=NONNEG, default=None, help="experts per MoE layer (0: dense; default: the model's)")
    m.add_argument("--expert-top-k", type=POS, default=None, help="experts per token (default: the model's, 2)")
    m.add_argument("--capacity-factor", type=POSF, default=None, help="expert capacity c (default dropless)")
    _arch_flags(m)
    c = p.add_argument_group("cluster (a preset, edited by the flags below)")
    c.add_argument("--cluster", default="a100", choices=sorted(CLUSTERS), help="a preset (pdist/plan/presets.py)")
    c.add_argument("--gpu-memory", type=POSF, default=None, help="GiB per GPU (default: the preset's)")
    c.add_argument("--gpus-per-node", type=POS, default=None, help="GPUs per node (default: the preset's)")
    c.add_argument("--intra-bw", type=POSF, default=None, help="GB/s per GPU per direction inside a node")
    c.add_argument("--inter-bw", type=POSF, default=None, help="GB/s per GPU per direction between nodes")
    c.add_argument("--peak-tflops", type=POSF, default=None, help="peak TFLOP/s per GPU at --precision")
    c.add_argument("--reserve-gib", type=_num(float, 0), default=None, help="GiB the context/NCCL/cache keep")
    lay = p.add_argument_group("layout")
    for k, h in (("dp", "data parallel"), ("tp", "tensor parallel"), ("pp", "pipeline stages"),
                 ("cp", "context parallel (the sequence split)"), ("ep", "expert parallel (divides dp)"),
                 ("m", "micro-batches per step"), ("v", "chunks per pipeline rank"), ("micro_batch", "rows per micro-batch")):
        lay.add_argument("--" + k.replace("_", "-"), type=POS, default=1, help=h)
    lay.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    lay.add_argument("--sp", action="store_true", help="sequence parallelism (with tp)")
    lay.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES), help="pipeline schedule")
    lay.add_argument("--cp-mode", default="ring", choices=list(CP_MODES), help="context parallelism's attention")
    lay.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                     help="activation recomputation (Korthikanti et al. 2022)")
    lay.add_argument("--precision", default="mixed", choices=sorted(BYTES),
                     help="mixed: bf16 params/grads, fp32 masters and Adam; fp8: the same with FP8 matmuls")
    lay.add_argument("--grad-dtype", default="auto", choices=["auto", "param", "fp32"],
                     help="gradients' dtype: fp32 main grads/accumulation buffers, or the params'; auto: fp32 "
                          "under --accounting megatron")
    lay.add_argument("--accounting", default="pdist", choices=list(ACCOUNTING), help="how memory is held")
    lay.add_argument("--no-overlap", action="store_true", help="expose every collective (a bound)")
    lay.add_argument("--attention", default="full", choices=["full", "flash"],
                     help="full: s x s scores computed and kept; flash: causal blocks only, none kept")
    lay.add_argument("--shard", type=NONNEG, default=0, help="ZeRO's shard group size (hybrid sharding, HSDP: "
                     "shards inside, replicas all-reduce across); 0: all of dp·cp")
    lay.add_argument("--offload", default="none", choices=["none", "optimizer", "params"],
                     help="ZeRO-Offload (optimizer, zero >= 1) or ZeRO-Infinity (params too, zero 3) to the host")
    lay.add_argument("--flops", default="6N+12LhT", choices=list(FLOP_CONVENTIONS), help="the MFU's FLOPs")
    lay.add_argument("--global-batch", type=NONNEG, default=0, help="rows per step: sets m = B/(dp·micro-batch)")
    o = p.add_argument_group("output")
    o.add_argument("--efficiency", type=POSF, default=None, help="one flat GEMM efficiency (default: the profile)")
    o.add_argument("--fit-fraction", type=POSF, default=FIT_FRACTION, help="fits = total under this x memory")
    o.add_argument("--search", action="store_true", help="rank every layout on --gpus that fits")
    o.add_argument("--gpus", type=POS, default=None, help="GPUs for --search (required with it)")
    o.add_argument("--top", type=POS, default=10, help="rows --search prints")
    o.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    o.add_argument("--png", metavar="PATH", default=None, help="memory bars as a PNG (matplotlib)")
    return p


def _model(args, p):
    if args.params:
        return float(args.params)
    moe = {k: v for k, v in (("n_expert", args.n_expert), ("expert_top_k", args.expert_top_k),
                             ("capacity_factor", args.capacity_factor)) if v is not None}
    if args.n_layer:
        miss = [f"--{k.replace('_', '-')}" for k in ("n_head", "n_embd") if getattr(args, k) is None]
        if miss:
            p.error(f"--n-layer {args.n_layer} needs {' and '.join(miss)} (the model's size)")
        kw = dict(vocab_size=args.vocab_size, block_size=args.seq_len or 1024, n_layer=args.n_layer,
                  n_head=args.n_head, n_embd=args.n_embd, **moe)
        if args.arch == "llama":
            cfg = LlamaConfig(n_kv_head=args.n_kv_head, intermediate_size=args.ffn, **kw)
        elif args.n_kv_head or args.ffn:
            p.error("--n-kv-head and --ffn need --arch llama (GPT-2 has MHA and a 4h MLP)")
        else:
            cfg = GPTConfig(**kw)
    else:
        cfg = MODELS[args.model]
        if moe and isinstance(cfg, (GPTConfig, LlamaConfig)):
            cfg = replace(cfg, **moe)
        elif moe:
            cfg = replace(cfg, **{{"expert_top_k": "top_k", "capacity_factor": "capacity"}.get(k, k): v
                                  for k, v in moe.items()})
    return _arch_edits(args, cfg)


def _arch_edits(args, cfg):
    """The flags only an Arch holds (shared experts, dense first layers, the MLP's kind, MLA)."""
    edits = {k: v for k, v in (("expert_ffn", args.expert_ffn), ("n_shared", args.n_shared_experts),
                               ("n_dense", args.n_dense_layers), ("mla", args.mla), ("window", args.window),
                               ("parallel", args.parallel_block or None)) if v is not None}
    if args.mlp:
        edits["gated"] = args.mlp == "swiglu"
    return replace(arch_of(cfg), **edits) if edits else cfg


def _cluster(args):
    cl = this_cluster() if args.cluster == "this" else CLUSTERS[args.cluster]
    edits = {}
    if args.gpu_memory:
        edits["memory"] = args.gpu_memory * 2 ** 30
    if args.gpus_per_node:
        edits["gpus_per_node"] = args.gpus_per_node
    if args.intra_bw:
        edits["intra"] = Link(args.intra_bw * 1e9, cl.intra.alpha)
    if args.inter_bw:
        edits["inter"] = Link(args.inter_bw * 1e9, cl.inter.alpha)
    if args.peak_tflops:
        edits["peak"] = dict(cl.peak, **{args.precision: args.peak_tflops * 1e12})
    if args.reserve_gib is not None:
        edits["reserve"] = args.reserve_gib * 2 ** 30
    if not edits:
        return cl
    return replace(cl, name=cl.name + " (edited: " + ", ".join(sorted(edits)) + ")", **edits)


def _a_later_rank():
    """True in a rank other than 0 of a launch (mpiexec, srun): the plan is the same on every
    rank, and rank 0 prints it (``--cluster this`` reads the launch's nodes: pdist/plan/here.py)."""
    from pdist import launcher
    ranks = [c[3] for c in launcher.claims() if c[3] is not None]
    return bool(ranks) and ranks[0] > 0


def _plans(args, p, model, cl, lay):
    if args.search:
        if args.gpus is None:
            p.error("--search needs --gpus N: the number of GPUs to lay out")
        if not isinstance(model, (GPTConfig, LlamaConfig)) and isinstance(model, float):
            p.error("--search needs a model (--model or --n-layer), not --params")
        keep = {k: getattr(lay, k) for k in ("schedule", "cp_mode", "grad_dtype", "accounting", "overlap", "flops",
                                             "attention")}
        return search(model, cl, args.gpus, args.global_batch, args.precision, args.micro_batch, args.seq_len,
                      args.efficiency, fit_fraction=args.fit_fraction, cps=sorted({1, args.cp}), **keep)[:args.top]
    return [plan(model, cl, lay, args.global_batch, args.efficiency, args.fit_fraction)]


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if _a_later_rank():
        return 0
    try:
        model = _model(args, p)
        cl = _cluster(args)
        lay = Layout(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero, sp=args.sp,
                     schedule=args.schedule, m=args.m, v=args.v, recompute=args.recompute, precision=args.precision,
                     micro_batch=args.micro_batch, seq_len=args.seq_len, cp_mode=args.cp_mode,
                     grad_dtype=args.grad_dtype, accounting=args.accounting, overlap=not args.no_overlap,
                     flops=args.flops, attention=args.attention, offload=args.offload, shard=args.shard)
        plans = _plans(args, p, model, cl, lay)
    except (ValueError, KeyError) as e:
        p.error(str(e))
    if args.json:
        out = {"plans": plans} if args.search else plans[0]
        print(json.dumps(dict(out, cluster=cl.name, source=cl.source), indent=1))
        return 0 if plans else 1
    psi = model if isinstance(model, float) else arch_of(model).num_params()
    act = None if isinstance(model, float) else arch_of(model).num_params(active=True)
    print(f"Ψ = {psi:,.0f} parameters" + (f" ({act:,.0f} active per token)" if act and act != psi else ""))
    print(header(cl, lay, plans, args.efficiency) + "\n")
    if not plans:
        print(f"no layout fits on {args.gpus} GPUs")
        return 1
    for w in dict.fromkeys(w for q in plans for w in q.get("warnings", [])):
        print("warning: " + w)
    print(table(plans) + "\n")
    if args.png and png_chart(plans, cl.memory, args.png):
        print(f"wrote {args.png}")
    else:
        print(text_chart(plans, cl.memory))
    print("(GiB per GPU; 'other' = fp32 grad sum + buffers + logits + temporaries + held + baseline + reserve; "
          f"{gib(cl.memory)} GiB)")
    return 0
