"""The planner's formulas: memory per GPU and time per step of one layout (pdist.plan).

Model states (Rajbhandari et al. 2020, §5; lesson 03 measures them): with k_p, k_g, k_o
bytes per element (pdist.plan.presets.BYTES; mixed precision 2 + 2 + 12) and N = dp,

    stage 0: k_p·Ψ_r       + k_g·Ψ_r       + k_o·Ψ_r
    stage 1: k_p·Ψ_pad     + k_g·Ψ_pad     + k_o·Ψ_pad/N
    stage 2: k_p·Ψ_pad     + k_g·Ψ_pad/N   + k_o·Ψ_pad/N
    stage 3: k_p·Ψ_pad/N   + k_g·Ψ_pad/N   + k_o·Ψ_pad/N

Ψ_r is what one GPU holds before ZeRO: its pipeline stage's units (root wte + wpe on the
first stage, a copy of wte for lm_head on the last, its blocks, ln_f on the last) with
every tensor-parallel tensor divided by t (lesson 06). Ψ_pad = Σ_units ⌈Ψ_u/N⌉·N pads
each flat unit to a multiple of N (docs/zero.md). Given only Ψ, one unit of Ψ/(t·p).

Activations per layer per micro-batch (Korthikanti et al. 2022, Table 2; 16-bit
activations, s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size):

    no recompute, TP         s·b·h·(10 + 24/t + 5·a·s/(h·t))     t = 1: sbh(34 + 5as/h)
    no recompute, TP + SP    s·b·h·(34/t + 5·a·s/(h·t))
    selective, TP            s·b·h·(10 + 24/t)
    selective, TP + SP       s·b·h·34/t
    full recompute           2·s·b·h                              (the layer's input)

times the layers of a stage and the micro-batches the first stage stashes: 1 without a
pipeline, GPipe m, 1F1B min(m, p), interleaved p·(1 + (p−1)/(p·v)) (Korthikanti et al.
2022, §4.2.3); zero bubble (a micro-batch held from its F until its W): ZB-H1 min(m, p)
on every stage, ZB-V min(m, p), DualPipeV min(2m, 2p+1)/2 (exact for m ≥ 2p, a bound
below), as pdist.parallel.pipeline.simulate.check_schedule counts them for pdist's
schedules. fp32/fp64 activations scale these by k_a/2 (an approximation).

Time per step (per GPU): compute = FLOPs/(N_gpus·peak·efficiency) with model FLOPs
(6Ψ + 12·L·s·h)·tokens (Narayanan et al. 2021, Eq. 3) plus recompute (full: 2Ψ + 4Lsh
per token, selective: 4Lsh); the pipeline bubble (p−1)/(v·m) of compute (GPipe, 1F1B,
interleaved), and with t_F = t_B = t_W (Qi et al. 2024): ZB-H1 (p−1 + max(0, p−m))/(3m),
ZB-V (p−1)/(6m) for m ≥ p, DualPipeV (p−1)/(6m) for m ≥ 2p; every collective
by α–β, t = steps·α + bytes_sent/β, over the link its group crosses. Nothing overlaps.
Bytes sent per group are pdist's ring accounting (docs/design.md), as lesson 06 counts them.
"""
import math
from dataclasses import asdict, dataclass

from pdist.plan.presets import BYTES, Cluster

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SHAPED = ("zb-v", "dualpipev")    # chunk 0 of rank r is stage r, chunk 1 stage 2p-1-r
SPLIT = {"attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias",
         "mlp.c_proj.weight"}     # + wte: the tensors tensor parallelism splits (lesson 06)


@dataclass
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"        # gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev
    m: int = 1                    # micro-batches per step (per data-parallel replica)
    v: int = 1                    # model chunks per pipeline rank (interleaved; zb-v, dualpipev: 2)
    recompute: str = "none"       # none | selective | full
    precision: str = "mixed"      # fp32 | fp64 | mixed
    micro_batch: int = 1          # rows per micro-batch
    seq_len: int = 0              # 0: the model's block_size

    def __post_init__(self):
        if self.schedule in V_SHAPED and self.v == 1:
            self.v = 2                # the V schedules run two chunks per rank

    def check(self, cfg=None):
        for k in ("dp", "tp", "pp", "m", "v", "micro_batch"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0-3, got {self.zero}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be none, selective or full, got {self.recompute!r}")
        if self.precision not in BYTES:
            raise ValueError(f"precision must be one of {sorted(BYTES)}, got {self.precision!r}")
        if self.schedule in V_SHAPED and self.v != 2:
            raise ValueError(f"schedule {self.schedule!r} runs two chunks per rank: v must be 2, got {self.v}")
        if self.v > 1 and self.schedule not in ("interleaved",) + V_SHAPED:
            raise ValueError("v > 1 needs schedule 'interleaved' (or zb-v / dualpipev, v = 2)")
        least = {"zb-v": self.pp, "dualpipev": 2 * self.pp}.get(self.schedule, 1)
        if self.pp > 1 and self.m < least:
            raise ValueError(f"schedule {self.schedule!r}: the planner's bubble formula needs m >= {least} "
                             f"micro-batches (pp = {self.pp}), got m = {self.m}")
        if self.zero == 3 and self.pp > 1:
            raise ValueError("ZeRO-3 does not compose with pipeline parallelism (pp > 1), as in pdist")
        if cfg is not None:
            if cfg.n_head % self.tp or cfg.n_embd % self.tp:
                raise ValueError(f"tp = {self.tp} must divide n_head = {cfg.n_head} and n_embd = {cfg.n_embd}")
            if self.pp * self.v > cfg.n_layer:
                raise ValueError(f"{self.pp * self.v} (virtual) stages but only {cfg.n_layer} layers")

    @property
    def gpus(self):
        return self.dp * self.tp * self.pp


def _spans(n_layers, n_stages):
    """Contiguous layer runs per virtual stage, as pdist.parallel.pipeline.stages.partition_layers."""
    counts = [n_layers // n_stages + (i < n_layers % n_stages) for i in range(n_stages)]
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return [(a, a + c) for a, c in zip(starts, counts)]


def virtual_stages(lay, r):
    """The virtual stages pipeline rank r holds, as pdist.parallel.pipeline.instructions places
    them: c·p + r for chunk c ("loop"), or r and 2p−1−r (zb-v, dualpipev: "v")."""
    if lay.schedule in V_SHAPED:
        return [r, 2 * lay.pp - 1 - r]
    return [c * lay.pp + r for c in range(lay.v)]


def stage_units(cfg, lay, pp_rank):
    """Elements per ZeRO unit on one GPU of pipeline rank ``pp_rank`` (one tp shard): the
    root (wte + wpe first; wte's lm_head copy last), each block, ln_f (last), as lesson 06."""
    V, t = lay.pp * lay.v, lay.tp
    ks = virtual_stages(lay, pp_rank)
    spans = _spans(cfg.n_layer, V)
    C = cfg.n_embd
    shapes = cfg.param_shapes()
    block = sum(math.prod(shapes["transformer.h.0." + n]) // (t if n in SPLIT else 1)
                for n in (k.split(".", 3)[3] for k in shapes if k.startswith("transformer.h.0.")))
    wte = cfg.vocab_size * C // t
    root = (wte + cfg.block_size * C if 0 in ks else 0) + (wte if V - 1 in ks and 0 not in ks else 0)
    units = [root] + [block] * sum(spans[k][1] - spans[k][0] for k in ks)
    if V - 1 in ks:
        units.append(2 * C)
    return units, sum(spans[k][1] - spans[k][0] for k in ks), ks


def model_states(units, lay):
    """(params, grads, optimizer) bytes per GPU, the formulas above."""
    kp, kg, ko, _ = BYTES[lay.precision]
    N, psi = lay.dp, sum(units)
    pad = sum(-(-u // N) * N for u in units)
    return {0: (kp * psi, kg * psi, ko * psi), 1: (kp * pad, kg * pad, ko * pad // N),
            2: (kp * pad, kg * pad // N, ko * pad // N),
            3: (kp * pad // N, kg * pad // N, ko * pad // N)}[lay.zero]


def layer_activations(s, b, h, a, t=1, sp=False, recompute="none"):
    """Bytes of one layer's stored activations for one micro-batch, Korthikanti et al. 2022,
    Table 2 (16-bit activations, 1-byte dropout masks)."""
    if recompute == "full":
        return 2 * s * b * h
    attn = 0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + attn)


def stash(lay, r=0):
    """Micro-batches of a whole stage's activations pipeline rank r holds at its peak: GPipe m,
    1F1B min(m, p − r), interleaved that times 1 + (p−1)/(p·v) (Korthikanti et al. 2022, §4.2.3);
    held until W: ZB-H1 min(m, p), ZB-V min(m, p), DualPipeV min(2m, 2p+1)/2 (the docstring)."""
    p, m, v = lay.pp, lay.m, lay.v
    if p == 1 and v == 1:
        return 1
    return {"gpipe": m, "1f1b": min(m, p - r), "interleaved": min(m, p - r) * (1 + (p - 1) / (p * v)),
            "zb-h1": min(m, p), "zb-v": min(m, p), "dualpipev": min(2 * m, 2 * p + 1) / 2}[lay.schedule]


def bubble_ratio(lay):
    """Idle over compute of the pipeline bubble: (p−1)/(v·m) for GPipe, 1F1B and interleaved; with
    t_F = t_B = t_W, ZB-H1 (p−1 + max(0, p−m))/(3m), ZB-V and DualPipeV (p−1)/(6m) (zero_bubble.py)."""
    p, m = lay.pp, lay.m
    if p == 1:
        return 0.0
    if lay.schedule == "zb-h1":
        return (p - 1 + max(0, p - m)) / (3 * m)
    if lay.schedule in V_SHAPED:
        return (p - 1) / (6 * m)
    return (p - 1) / (lay.v * m)


def group_bytes(cfg, lay, pp_rank, units=None):
    """Bytes one GPU of ``pp_rank`` sends per step in each group, ring accounting, as lesson 06:
    dp: stage 0 2(N−1)/N·k·Ψ_r, 1–2 2(N−1)/N·k·Ψ_pad, 3 (2m+1)(N−1)/N·k·Ψ_pad; pp: one activation
    (s·b·h/t with SP) forward and one gradient back per micro-batch and chunk boundary; tp:
    Megatron's 4 all-reduces (SP: 4 all-gathers + 4 reduce-scatters) per layer and micro-batch
    (+2 with full recompute), embedding and head 2 each, the loss, SP's partial grads."""
    kp, _, _, ka = BYTES[lay.precision]
    if units is None:
        units = stage_units(cfg, lay, pp_rank)[0]
    _, L, ks = stage_units(cfg, lay, pp_rank)
    N, t, m, psi = lay.dp, lay.tp, lay.m, sum(units)
    pad = sum(-(-u // N) * N for u in units)
    dp = {0: 2 * psi, 1: 2 * pad, 2: 2 * pad, 3: (2 * m + 1) * pad}[lay.zero] * (N - 1) * kp / N
    s, C, V = lay.seq_len or cfg.block_size, cfg.n_embd, lay.pp * lay.v
    act = lay.micro_batch * s // (t if lay.sp else 1) * C * ka
    hops = sum((k < V - 1) + (k > 0) for k in ks) - 2 * (lay.schedule in V_SHAPED and pp_rank == lay.pp - 1)
    pp = m * act * hops                      # the V's turn (stage p-1 -> p on rank p-1) is a local copy
    S, ring = lay.micro_batch * s * C * ka, (t - 1) / t
    per_layer = 8 + 4 * (lay.recompute == "full")
    per_mb = (per_layer * L + 2 * (0 in ks) + 2 * (V - 1 in ks)) * ring * S
    per_mb += (V - 1 in ks) * 2 * ring * 3 * lay.micro_batch * s * ka
    tp = m * per_mb
    if lay.sp and t > 1:
        tp += 2 * ring * (L * 6 * C + 2 * C * (V - 1 in ks) + s * C * (0 in ks)) * kp
    calls = {"dp": len(units) * (2 * (N - 1) if lay.zero < 3 else (2 * m + 1) * (N - 1)),
             "tp": m * (per_layer * L + 6) * (t - 1), "pp": m * hops}
    return {"dp": dp if N > 1 else 0.0, "tp": tp if t > 1 else 0.0, "pp": float(pp)}, \
        {k: (c if v else 0) for (k, c), v in zip(calls.items(), (N > 1, t > 1, pp > 0))}


def crosses(stride, size, gpus_per_node):
    """A group of ``size`` ranks ``stride`` apart (Megatron's order: tp, then dp, then pp) spans
    nodes iff stride·size > GPUs per node."""
    return size > 1 and stride * size > gpus_per_node


def plan_config(cfg, cluster: Cluster, lay: Layout, global_batch=0, efficiency=None):
    """The plan of one layout for a GPTConfig: a dict (see pdist.plan)."""
    lay.check(cfg)
    if global_batch:
        if global_batch % (lay.dp * lay.micro_batch):
            raise ValueError(f"global batch {global_batch} must divide into dp {lay.dp} x micro-batch "
                             f"{lay.micro_batch}")
        lay.m = global_batch // (lay.dp * lay.micro_batch)
    B = lay.dp * lay.m * lay.micro_batch
    s, h, a, Lm = lay.seq_len or cfg.block_size, cfg.n_embd, cfg.n_head, cfg.n_layer
    kp, _, _, ka = BYTES[lay.precision]
    stages = []
    for r in range(lay.pp):
        units, L, _ = stage_units(cfg, lay, r)
        p_, g_, o_ = model_states(units, lay)
        act = L * layer_activations(s, lay.micro_batch, h, a, lay.tp, lay.sp, lay.recompute) * ka / 2
        act *= stash(lay, r)
        buf = 2 * max(units) * kp if lay.zero == 3 and lay.dp > 1 else 0   # ZeRO-3: gathered + prefetched unit
        sent, calls = group_bytes(cfg, lay, r, units)
        stages.append({"params": p_, "grads": g_, "optimizer": o_, "activations": round(act),
                       "buffers": buf, "total": p_ + g_ + o_ + round(act) + buf, "comm_bytes": sent,
                       "comm_calls": calls})
    worst = max(stages, key=lambda d: d["total"])
    tokens = B * s
    fpt = 6 * cfg.num_params() + 12 * Lm * s * h
    extra = {"none": 0, "selective": 4 * Lm * s * h, "full": 2 * cfg.num_params() + 4 * Lm * s * h}[lay.recompute]
    eff = cluster.efficiency if efficiency is None else efficiency
    peak = cluster.peak[lay.precision]
    compute = (fpt + extra) * tokens / lay.gpus / (peak * eff)
    bubble = compute * bubble_ratio(lay)
    g = cluster.gpus_per_node
    links = {"tp": crosses(1, lay.tp, g), "dp": crosses(lay.tp, lay.dp, g), "pp": crosses(lay.tp * lay.dp, lay.pp, g)}
    comm = {}
    for k in ("tp", "pp", "dp"):
        link = cluster.inter if links[k] else cluster.intra
        st = max(stages, key=lambda d: d["comm_bytes"][k])
        comm[k] = st["comm_calls"][k] * link.alpha + st["comm_bytes"][k] / link.beta
    total = compute + bubble + sum(comm.values())
    return {
        "memory_per_gpu": {k: worst[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "total")},
        "memory_per_stage": stages,
        "fits": worst["total"] <= cluster.memory,
        "time_per_step": {"compute": compute, "bubble": bubble, **{f"comm_{k}": v for k, v in comm.items()},
                          "total": total},
        "links": {k: ("inter-node" if v else "intra-node") for k, v in links.items()},
        "mfu": fpt * tokens / lay.gpus / (peak * total),
        "tflops_per_gpu": (fpt + extra) * tokens / lay.gpus / total / 1e12,
        "tokens_per_s": tokens / total,
        "global_batch": B, "seq_len": s, "params": cfg.num_params(),
        "layout": asdict(lay), "efficiency": eff, "gpus": lay.gpus,
    }


def plan_params(psi, cluster, lay, efficiency=None):
    """Model-state memory only, from Ψ alone: one unit of ⌈Ψ/(t·p)⌉ per GPU."""
    lay.check()
    p_, g_, o_ = model_states([-(-int(psi) // (lay.tp * lay.pp))], lay)
    mem = {"params": p_, "grads": g_, "optimizer": o_, "activations": None, "buffers": None,
           "total": p_ + g_ + o_}
    return {"memory_per_gpu": mem, "fits": mem["total"] <= cluster.memory, "time_per_step": None,
            "mfu": None, "tokens_per_s": None, "params": int(psi), "layout": asdict(lay), "gpus": lay.gpus}
