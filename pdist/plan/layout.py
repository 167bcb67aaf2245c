"""A layout the planner plans (``Layout``), its checks, and the pipeline schedules' stash and bubble.

Ranks are placed in Megatron-LM's order, fastest first: tp, cp, dp (ep is carved out of dp: the
ep ranks of a group are consecutive dp ranks, as pdist's DeviceMesh builds them), pp. The GPUs
are dp·tp·pp·cp. Stash and bubble (Korthikanti et al. 2022, §4.2.3; Qi et al. 2024, "Zero
Bubble Pipeline Parallelism", with t_F = t_B = t_W) are the formulas pdist's own schedules
meet (tests/test_schedules.py checks them against pdist.parallel.pipeline.simulate).
"""
from dataclasses import dataclass

from pdist.plan.presets import BYTES

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SHAPED = ("zb-v", "dualpipev")    # chunk 0 of rank r is stage r, chunk 1 stage 2p-1-r
ACCOUNTING = ("pdist", "paper", "deepspeed", "megatron")
CP_MODES = ("ring", "ulysses")
OFFLOAD = ("none", "optimizer", "params")
# pdist's own refusal, word for word (pdist.parallel.parallelize.check_layout; tests/test_plan.py
# checks that the two stay equal: the planner does not import pdist.parallel, which starts MPI)
ZERO3_PIPELINE = ("ZeRO-3 does not compose with pipeline parallelism (pp > 1): it would gather "
                  "every unit 2m times per step (3m with a zero-bubble schedule's split backward). "
                  "Use zero_stage <= 2 with pp > 1.")


@dataclass
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                   # context parallelism: the sequence split over cp ranks
    ep: int = 1                   # expert parallelism: E/ep experts per rank, ep dividing dp
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"        # gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev
    m: int = 1                    # micro-batches per step (per data-parallel replica)
    v: int = 1                    # model chunks per pipeline rank (interleaved; zb-v, dualpipev: 2)
    recompute: str = "none"       # none | selective | full
    precision: str = "mixed"      # fp32 | fp64 | mixed | fp8
    micro_batch: int = 1          # rows per micro-batch
    seq_len: int = 0              # 0: the model's block_size
    cp_mode: str = "ring"         # ring | ulysses
    grad_dtype: str = "auto"      # auto | param | fp32: the gradients' (accumulation buffers') dtype
    accounting: str = "pdist"     # pdist | paper | deepspeed | megatron: how memory is held
    overlap: bool = True          # dp, ZeRO-3, pp, cp (ring) overlap compute as the docs say
    flops: str = "6N+12LhT"       # the model-FLOP convention of the MFU (pdist.plan.arch)
    attention: str = "full"       # full: s x s scores computed and kept; flash: causal blocks only, none kept
    offload: str = "none"         # none | optimizer (ZeRO-Offload) | params (ZeRO-Infinity): to host memory
    shard: int = 0                # ZeRO's shard group (HSDP: shard inside, replicas across); 0: all of dp·cp

    def __post_init__(self):
        if self.schedule in V_SHAPED and self.v == 1:
            self.v = 2                # the V schedules run two chunks per rank

    def check(self, arch=None):
        """Every error of the layout (and of it on ``arch``), as a ValueError naming the input."""
        for k in ("dp", "tp", "pp", "cp", "ep", "m", "v", "micro_batch"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {getattr(self, k)!r}")
        choices = {"zero": (0, 1, 2, 3), "schedule": SCHEDULES, "recompute": ("none", "selective", "full"),
                   "precision": tuple(BYTES), "cp_mode": CP_MODES, "grad_dtype": ("auto", "param", "fp32"),
                   "accounting": ACCOUNTING, "attention": ("full", "flash"), "offload": OFFLOAD}
        for k, ok in choices.items():
            if getattr(self, k) not in ok:
                raise ValueError(f"{k} must be one of {', '.join(map(str, ok))}, got {getattr(self, k)!r}")
        if self.schedule in V_SHAPED and self.v != 2:
            raise ValueError(f"schedule {self.schedule!r} runs two chunks per rank: v must be 2, got {self.v}")
        if self.v > 1 and self.schedule not in ("interleaved",) + V_SHAPED:
            raise ValueError("v > 1 needs schedule 'interleaved' (or zb-v / dualpipev, v = 2)")
        least = {"zb-v": self.pp, "dualpipev": 2 * self.pp}.get(self.schedule, 1)
        if self.pp > 1 and self.m < least:
            raise ValueError(f"schedule {self.schedule!r}: the planner's bubble formula needs m >= {least} "
                             f"micro-batches (pp = {self.pp}), got m = {self.m}")
        if self.zero == 3 and self.pp > 1:
            raise ValueError(ZERO3_PIPELINE)
        if self.offload != "none" and self.zero < (3 if self.offload == "params" else 1):
            raise ValueError(f"offload {self.offload!r} moves ZeRO's shards to the host: it needs zero >= "
                             f"{3 if self.offload == 'params' else 1}, got zero = {self.zero}")
        if self.accounting == "deepspeed" and self.zero >= 2 and self.pp > 1:
            raise ValueError(f"DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only: zero = {self.zero} with "
                             f"pp = {self.pp}; use --zero 1 (or another --accounting)")
        if self.shard and (not isinstance(self.shard, int) or self.shard < 1 or (self.dp * self.cp) % self.shard
                           or self.zero < 1 or self.ep > 1):
            raise ValueError(f"shard = {self.shard!r} (hybrid sharding) must be an integer dividing dp·cp = "
                             f"{self.dp * self.cp}, with zero >= 1 and ep = 1 (got zero {self.zero}, ep {self.ep})")
        if self.dp % self.ep:
            raise ValueError(f"ep = {self.ep} must divide dp = {self.dp} (expert parallelism is carved out of "
                             f"data parallelism)")
        if arch is not None:
            self._check_arch(arch)

    def _check_arch(self, a):
        if a.n_head % self.tp or a.h % self.tp or a.n_kv_head % self.tp and self.tp % a.n_kv_head:
            raise ValueError(f"tp = {self.tp} must divide n_head = {a.n_head} and n_embd = {a.h} "
                             f"(and n_kv_head = {a.n_kv_head}, or be a multiple of it)")
        if self.pp * self.v > a.n_layer:
            raise ValueError(f"{self.pp * self.v} (virtual) stages but only {a.n_layer} layers")
        s = self.seq_len or a.seq
        if s % self.cp or (self.sp and (s // self.cp) % self.tp):
            raise ValueError(f"seq_len {s} must divide by cp = {self.cp} (and its shard by tp = {self.tp} with SP)")
        if self.cp_mode == "ulysses" and a.n_head % (self.cp * self.tp):
            raise ValueError(f"Ulysses over cp = {self.cp} needs n_head = {a.n_head} divisible by cp·tp")
        if self.ep > 1 and (not a.moe or a.n_expert % self.ep):
            raise ValueError(f"ep = {self.ep} needs a mixture-of-experts model whose n_expert "
                             f"({a.n_expert}) it divides: set --n-expert")

    @property
    def zero_n(self):
        """The ranks a dense unit is sharded over: the shard group (HSDP), else dp·cp."""
        return self.shard or self.dp * self.cp

    @property
    def gpus(self):
        return self.dp * self.tp * self.pp * self.cp

    def grad_bytes(self, kg):
        """Bytes per gradient element: fp32 main grads (Megatron's default) or the params' dtype."""
        g = self.grad_dtype if self.grad_dtype != "auto" else ("fp32" if self.accounting == "megatron" else "param")
        return 4 if g == "fp32" and self.precision in ("mixed", "fp8") else kg


def spans(n_layers, n_stages):
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


def stash(lay, r=0):
    """Micro-batches of a whole stage's activations pipeline rank r holds at its peak: GPipe m,
    1F1B min(m, p − r), interleaved that times 1 + (p−1)/(p·v) (Korthikanti et al. 2022, §4.2.3);
    held until W: ZB-H1 min(m, p), ZB-V min(m, p), DualPipeV min(2m, 2p+1)/2."""
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


def strides(lay):
    """(stride, size) of each group in the rank order tp, cp, dp (ep its first factor), pp."""
    t, c, d = lay.tp, lay.cp, lay.dp
    out = {"tp": (1, t), "cp": (t, c), "dp": (t * c, d), "ep": (t * c, lay.ep), "pp": (t * c * d, lay.pp)}
    if lay.shard:                      # HSDP: the shard group is the first `shard` of the dp·cp ranks
        out.update(dp=(t, lay.shard), dp_rep=(t * lay.shard, d * c // lay.shard))
    return out


def crosses(stride, size, gpus_per_node):
    """A group of ``size`` ranks ``stride`` apart spans nodes iff stride·size > GPUs per node."""
    return size > 1 and stride * size > gpus_per_node
