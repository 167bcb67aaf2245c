"""Lesson 10 -- mixture of experts and expert parallelism.

    mpirun -n 4 python lessons/10_experts.py                     # ep 2 and ep 4 (dp 4), GPT, E = 4, top-2
    mpirun -n 2 python lessons/10_experts.py                     # ep 2
    python lessons/10_experts.py                                 # 1 process: routing, drops, memory
    mpirun -n 4 python lessons/10_experts.py --model llama --capacity-factor 1.0 --plot moe.png

Math (docs/experts.md; Shazeer et al. 2017, GShard 2020, Switch 2021). For the N tokens x_n
of one rank's shard, p_n = softmax(x_n W_gate) over E experts, S_n = the top-k of p_n, and
y_n = sum_{e in S_n} w_ne expert_e(x_n) with w_ne = p_ne / sum_{S_n} p. Capacity c (None:
dropless, the default): expert e keeps at most ceil(c N k / E) of the N k assignments, so
the shard drops sum_e max(0, routed_e - ceil(c N k / E)). The aux loss (Switch eq. 4) is
coef E sum_e f_e P_e. Expert parallelism (DeviceMesh(dp=n, ep=ep)) gives each rank E/ep
experts; each MoE layer sends a token's row to the rank of each chosen expert
(all_to_all_v) and the result back, and backward does both again in reverse:

    bytes per MoE layer on rank r = 2 (S_r + R_r) C b    S_r: rows r sends to the other ep
                                                         ranks, R_r: rows it gets from them
    uniform routing: S = R = N k (ep-1)/ep: 4 N k C b (ep-1)/ep (twice forward, twice backward)
    expert parameters per rank = E/ep of the replicated E (and so their grads and Adam m, v)

It prints (rank 0, from every rank): tokens per expert per step and layer (a text histogram;
--plot PATH: a PNG); the drops at capacity None / 1.0 / 1.25 beside the formula; each rank's
all_to_all_v bytes per step beside 2 (S + R) C b (exact, from the counts) and the uniform
formula, and a planted uniform routing against it; expert bytes per rank beside E/ep, replicated.
PASS means: for each ep, --steps AdamW steps equal one process on the same
global batch (Local with dp micro-batches: the same shards, so the same routing, drops
and aux loss) -- every loss and every parameter by its global name, the router and every
expert, float64 rtol 1e-9 -- and every count above equals its formula exactly.
"""
import importlib.util
import math
import time

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.models import registry
from pdist.models.moe import moe_layers, moe_stats
from pdist.parallel import Local, parallelize
from pdist.training import train

CAPACITIES = (None, 1.0, 1.25)


def parse():
    p = lesson.parser(__doc__, steps=4, dtype="float64", batch_size=8, n_head=2, n_embd=32, block_size=16, models=True)
    p.add_argument("--n-expert", type=int, default=4, help="experts per MoE layer (default %(default)s)")
    p.add_argument("--expert-top-k", type=int, default=2, help="experts per token (default %(default)s)")
    p.add_argument("--capacity-factor", type=float, default=None, help="None: dropless (the default)")
    p.add_argument("--router-aux-loss-coef", type=float, default=0.01)
    p.add_argument("--ep", type=int, action="append", default=None,
                   help="expert-parallel sizes to run (repeatable; default: 2 and 4, those dividing the world and E)")
    p.add_argument("--plot", metavar="PATH", default=None, help="also draw tokens per expert (matplotlib PNG)")
    args = lesson.validate(p, p.parse_args())
    if args.n_expert < 1 or not 1 <= args.expert_top_k <= args.n_expert:
        p.error(f"--n-expert must be >= 1 and --expert-top-k in 1..n_expert; got {args.n_expert}, {args.expert_top_k}")
    if args.capacity_factor is not None and not args.capacity_factor > 0:
        p.error(f"--capacity-factor must be > 0 (leave it out for dropless), got {args.capacity_factor}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:      # fail now, not after the run
        p.error("--plot needs matplotlib: .venv/bin/pip install 'pdist[plots]' (or leave out --plot)")
    return p, args


def check_layout(parser, args, n):
    """Every rank stops here with the same message on a bad layout (before any collective)."""
    if args.ep is None:
        args.ep = [e for e in (2, 4) if n % e == 0 and args.n_expert % e == 0]
    for ep in args.ep:
        if ep < 2 or n % ep or args.n_expert % ep:
            parser.error(f"--ep {ep}: must be >= 2, divide the world ({n} ranks: dp = {n}) and "
                         f"--n-expert {args.n_expert}; choose another --ep or --n-expert")
    if args.batch_size % n:
        parser.error(f"--batch-size {args.batch_size} must divide into dp = {n} ranks")


def reference(cfg, batch, args, dp):
    """One process, dp micro-batches (each a dp rank's shard): (losses, state_dict, model,
    tokens per expert of each step {layer: [E]})."""
    model = Local(registry.build(cfg, args.seed), microbatches=dp)
    per_step = []
    losses = train(model, lesson.make_adamw(model.parameters()), batch, args.steps,
                   on_step=lambda step, loss: per_step.append({n: s["tokens"] for n, s in moe_stats(model.module).items()}))
    return losses, model.module.state_dict(), model, per_step


def expert_run(world, cfg, batch, args, ep, ref_losses, ref_sd):
    """Train under DeviceMesh(dp=n, ep=ep); returns this run's numbers (every rank)."""
    mesh = comm.DeviceMesh(dp=world.size, ep=ep)
    model = parallelize(registry.build(cfg, args.seed), mesh)
    opt = lesson.make_adamw(model.parameters())
    steps, times = [], []
    mesh.ep_group.reset_stats()

    def on_step(step, loss):        # this step's all_to_all_v bytes, and every rank's tokens per expert
        sent = mesh.ep_group.stats.get("all_to_all_v", {}).get("bytes", 0)
        mesh.ep_group.reset_stats()
        steps.append((world.all_gather_object({n: s["tokens"] for n, s in moe_stats(model.module).items()}), sent))
        times.append(time.perf_counter())

    t0 = time.perf_counter()
    losses = train(model, opt, batch, args.steps, on_step=on_step)
    secs = float(np.median(np.diff([t0] + times)))
    ok = np.allclose(losses, ref_losses, rtol=1e-9, atol=0) and all(   # every parameter by its global name
        np.allclose(p.data, ref_sd[getattr(p, "global_name", n)], rtol=1e-9, atol=1e-12) for n, p in model.named_parameters())
    flag = agree(world, ok)
    b, C, N, k = np.dtype(args.dtype).itemsize, cfg.n_embd, args.batch_size // world.size * cfg.block_size, cfg.expert_top_k
    per_layer = [exact_bytes(toks, world.rank, ep, cfg.n_expert, C, b) for toks, _ in steps]
    a2a = [(sent, sum(e.values())) for (_, sent), e in zip(steps, per_layer)]
    uniform = 4 * N * k * C * b * (ep - 1) // ep * len(moe_layers(model.module))
    mem = expert_memory(model, cfg, ep, b)
    return dict(model=model, ok=bool(flag[0]), losses=losses, secs=secs, per_layer=per_layer, mem=mem,
                tokens=[t for t, _ in steps], a2a=a2a, uniform=uniform, a2a_ok=all(s == e for s, e in a2a))


def agree(world, ok):
    """[1.0] when ``ok`` on every rank, else [0.0] (on every rank)."""
    flag = np.array([1.0 if ok else 0.0])
    world.all_reduce(flag, op="min")
    return flag


def exact_bytes(toks, d, ep, E, C, b):
    """{layer: 2 (S + R) C b} of world rank d (= dp rank) from every rank's tokens per expert."""
    r, g0, El = d % ep, d - d % ep, E // ep
    out = {}
    for name in toks[d]:
        mine = toks[d][name]
        S = sum(mine) - sum(mine[r * El:(r + 1) * El])
        R = sum(sum(toks[q][name][r * El:(r + 1) * El]) for q in range(g0, g0 + ep) if q != d)
        out[name] = 2 * (S + R) * C * b
    return out


def expert_memory(model, cfg, ep, b):
    """(expert bytes on this rank, formula E/ep x per-expert x layers x b, replicated, dense bytes)."""
    per_expert = sum(math.prod(s) for n, s in cfg.param_shapes().items() if ".experts.0." in n) // cfg.n_layer
    names = [(".experts." in getattr(p, "global_name", n), p.data.nbytes) for n, p in model.named_parameters()]
    got, dense = sum(nb for e, nb in names if e), sum(nb for e, nb in names if not e)
    return got, cfg.n_layer * cfg.n_expert // ep * per_expert * b, cfg.n_layer * cfg.n_expert * per_expert * b, dense


def capacity_drops(world, module, cfg, batch, args):
    """{cf: (dropped counted, dropped by the formula, assignments)} summed over the ranks, from
    forwards of the --steps batches on this rank's shard (module: one process's or an EP
    rank's model)."""
    out = {}
    layers = [m for _, m in moe_layers(module)]
    for cf in CAPACITIES:
        counted = formula = assigned = 0
        for layer in layers:
            layer.capacity_factor = cf
        for step in range(args.steps):
            x, y = data.shard(batch(step), world.rank, world.size)
            moe_stats(module)                                       # reset
            module(x, y)
            N = x.size
            for s in moe_stats(module).values():                    # one call per layer
                cap = math.inf if cf is None else math.ceil(cf * N * cfg.expert_top_k / cfg.n_expert)
                formula += int(sum(max(0, r - cap) for r in s["routed"]))
                counted += s["dropped"]
                assigned += sum(s["routed"])
        tot = np.array([counted, formula, assigned], dtype=np.float64)
        world.all_reduce(tot)
        out[cf] = tuple(int(v) for v in tot)
    for layer in layers:          # back to the config's
        layer.capacity_factor = cfg.capacity_factor
    return out


def uniform_check(world, ep, N, args):
    """A planted uniform routing on one GPT MoE layer (token n to experts n mod E and n+1 mod E):
    (measured all_to_all_v bytes of its forward + backward, 4 N k C b (ep-1)/ep)."""
    from pdist import Tensor
    E, C, k = args.n_expert, args.n_embd, 2
    cfg = lesson.gpt_config(8, dtype=args.dtype, n_layer=1, n_head=1, n_embd=C, block_size=8, n_expert=E,
                            expert_top_k=k)
    mesh = comm.DeviceMesh(dp=world.size, ep=ep)
    layer = parallelize(registry.build(cfg, 0), mesh).module.blocks[0].mlp
    layer.gate.weight.data[...] = np.eye(C, E) + np.eye(C, E, -E)          # feature i -> expert i mod E
    x = np.zeros((N, C))
    x[np.arange(N), np.arange(N) % E] = 10.0
    x[np.arange(N), E + (np.arange(N) + 1) % E] = 5.0
    mesh.ep_group.reset_stats()
    layer(Tensor(x, requires_grad=True)).sum().backward()
    return mesh.ep_group.stats["all_to_all_v"]["bytes"], 4 * N * k * C * np.dtype(args.dtype).itemsize * (ep - 1) // ep


def main():
    parser, args = parse()
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    check_layout(parser, args, world.size)
    cfg = lesson.gpt_config(tok.vocab_size, dtype=args.dtype, model=args.model, n_expert=args.n_expert,   # (flags
                            expert_top_k=args.expert_top_k, capacity_factor=args.capacity_factor,      # checked
                            router_aux_loss_coef=args.router_aux_loss_coef,                            # in parse)
                            **{k: getattr(args, k) for k in lesson.MODEL_DEFAULTS})
    N = args.batch_size // world.size * cfg.block_size
    batch = data.batch_fn(tokens, args.batch_size, cfg.block_size, args.seed)      # step -> the global (x, y)
    ref_losses, ref_sd, ref, ref_tokens = reference(cfg, batch, args, world.size)
    runs = [expert_run(world, cfg, batch, args, ep, ref_losses, ref_sd) for ep in args.ep]
    last = runs[-1]["model"].module if runs else ref.module
    drops = capacity_drops(world, last, cfg, batch, args)
    can_plant = args.n_embd >= 2 * args.n_expert and N % args.n_expert == 0
    uniform = {ep: uniform_check(world, ep, N, args) for ep in args.ep} if can_plant else {}
    rows = world.all_gather_object([(r["a2a"], r["mem"], r["per_layer"]) for r in runs])
    one = expert_memory(ref, cfg, 1, np.dtype(args.dtype).itemsize)              # one process: all E
    ok = all(r["ok"] and r["a2a_ok"] for r in runs) and all(a == b for a, b, _ in drops.values()) \
        and all(g == w for g, w in uniform.values()) and all(m[0] == m[1] for rk in rows for _, m, _ in rk) \
        and one[0] == one[1] == one[2]
    flag = agree(world, ok)
    if world.rank == 0:
        per_step = summed(runs[-1]["tokens"]) if runs else ref_tokens      # the EP run's routing, all ranks
        report(args, cfg, runs, rows, drops, uniform, per_step, N, one)
    summary = [run_summary(args, cfg, world, r, ep, rows, ref_losses) for ep, r in zip(args.ep, runs)]
    summary += [{"name": "capacity", "drops": [dict(capacity_factor=cf, dropped=a, formula=b, assignments=n)
                                              for cf, (a, b, n) in drops.items()]},
                {"name": "uniform routing", "a2a_bytes": [dict(ep=e, measured=g, formula=w) for e, (g, w) in uniform.items()]}]
    lesson.finish("10_experts", bool(flag[0]), summary, args, rank=world.rank, world_size=world.size,
                  detail=f"(E = {cfg.n_expert}, top-{cfg.expert_top_k}, " + (
                      f"ep {', '.join(map(str, args.ep))}: every loss, the router and every expert equal one "
                      f"process; drops, all-to-all bytes and expert memory equal their formulas)" if runs else
                      "one process: drops and expert memory equal their formulas; mpirun -n 4 for ep 2 and 4)"))


def run_summary(args, cfg, world, r, ep, rows, ref_losses):
    i = args.ep.index(ep)
    return {"name": f"ep {ep}", "layout": {"dp": world.size, "ep": ep, "tp": 1, "pp": 1, "zero_stage": 0},
            "dtype": args.dtype, "params": cfg.num_params(), "n_expert": cfg.n_expert,
            "expert_top_k": cfg.expert_top_k, "capacity_factor": cfg.capacity_factor,
            "loss": r["losses"], "baseline_loss": list(ref_losses),
            "memory_per_rank": [dict(rank=q, expert_params_bytes=m[0], formula_bytes=m[1], replicated_bytes=m[2],
                                     dense_params_bytes=m[3]) for q, m in ((q, rk[i][1]) for q, rk in enumerate(rows))],
            "comm_bytes_per_step": [float(np.median([s for s, _ in rk[i][0]])) for rk in rows],
            "a2a_bytes_per_step": [[dict(measured=s, exact=e) for s, e in rk[i][0]] for rk in rows],
            "a2a_bytes_per_layer": [rk[i][2] for rk in rows], "a2a_uniform_formula_per_step": r["uniform"],
            "tokens_per_expert": summed(r["tokens"]), "seconds_per_step": r["secs"]}


def summed(tokens):
    """[{layer: tokens per expert summed over the ranks}] per step, from each step's gathered ranks."""
    return [{n: np.sum([t[n] for t in toks], axis=0).tolist() for n in toks[0]} for toks in tokens]


def histogram(per_step, width=12):
    """Tokens per expert, one line per step and layer, bars scaled to the largest count."""
    top = max([max(v) for t in per_step for v in t.values()] + [1])
    return "\n".join(f"step {step} {name:<16} " + "  ".join(f"e{e} {'#' * round(width * c / top):<{width}} {c:>4}"
                                                            for e, c in enumerate(v))
                     for step, t in enumerate(per_step) for name, v in t.items())


def plot(per_step, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(per_step[0])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3), squeeze=False)
    for ax, name in zip(axes[0], names):
        v = np.array([t[name] for t in per_step])                 # (steps, E)
        for s in range(v.shape[0]):
            ax.bar(np.arange(v.shape[1]) + s / (v.shape[0] + 1), v[s], width=1 / (v.shape[0] + 1), label=f"step {s}")
        ax.set(title=name, xlabel="expert", ylabel="tokens")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def report(args, cfg, runs, rows, drops, uniform, per_step, N, one):
    fb = lesson.fmt_bytes
    print(f"{args.model} Ψ = {cfg.num_params():,} ({cfg.n_layer} MoE layers, E = {cfg.n_expert}, top-{cfg.expert_top_k}, "
          f"capacity {cfg.capacity_factor or 'dropless'}, n_embd {cfg.n_embd}, {args.dtype}); global batch "
          f"{args.batch_size} x {cfg.block_size}, N = {N} tokens per rank per layer, {args.steps} steps\n")
    print("tokens per expert (after drops, all ranks):\n" + histogram(per_step) + "\n")
    if args.plot:
        plot(per_step, args.plot)
        print(f"wrote {args.plot}\n")
    print(lesson.table([(str(cf), a, b, "yes" if a == b else "NO", n, f"{a / max(n, 1):.1%}")
                        for cf, (a, b, n) in drops.items()],
                       ["capacity factor", "dropped", "formula", "=", "assignments", "dropped %"]))
    print(f"\none process: expert params {fb(one[0])} (all E = {cfg.n_expert}: formula {fb(one[1])}), dense {fb(one[3])}")
    for i, (ep, r) in enumerate(zip(args.ep, runs)):
        print(f"\nep {ep} (dp {len(rows)}): {r['secs'] * 1e3:.1f} ms/step; all_to_all_v bytes per step over the "
              f"{cfg.n_layer} MoE layers (median; uniform: {fb(r['uniform'] // cfg.n_layer)} a layer), and expert "
              f"memory, each rank; losses, router and every "
              f"expert = 1 process: {'yes' if r['ok'] else 'NO'}")
        table = [(q, fb(np.median([s for s, _ in a2a])), "yes" if all(s == e for s, e in a2a) else "NO",
                  fb(r["uniform"]), fb(mem[0]), fb(mem[1]), fb(mem[2]), fb(mem[3])) for q, (a2a, mem, _) in
                 ((q, rk[i]) for q, rk in enumerate(rows))]
        print(lesson.table(table, ["rank", "sent/step", "= 2(S+R)Cb", "uniform formula", "expert params",
                                   "E/ep formula", "replicated", "dense params"]))
    for ep, (got, want) in uniform.items():
        print(f"planted uniform routing, ep {ep}: {fb(got)} measured, 4 N k C b (ep-1)/ep = {fb(want)} "
              f"{'(equal)' if got == want else '(DIFFERENT)'}")
    print()


if __name__ == "__main__":
    main()
