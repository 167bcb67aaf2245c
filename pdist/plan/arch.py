"""What the planner knows of a model: parameters by role, total and active, FLOPs and GEMMs per token.

An ``Arch`` is built from a pdist config (``GPTConfig``, ``LlamaConfig``, with or without
experts) by ``arch_of``, or directly for a published model pdist cannot build (shared
experts, dense first layers: DeepSeek-V3). With h the width, a heads of d = h/a, a_kv
key/value heads (GQA, Ainslie et al. 2023), f the MLP width, E experts of width f_e, k
per token (Shazeer et al. 2017; Fedus et al. 2021):

    attention   h·a·d + 2·h·a_kv·d + a·d·h   (+ biases 4h for GPT-2)      q, k, v, o
    MLP         GELU 2·h·f (+ f + h);  SwiGLU 3·h·f (Shazeer 2020)        dense or per expert
    MoE layer   E·MLP(f_e) + S·MLP(f_e) + router h·E                     S shared experts
    embeddings  V·h (+ s·h learned positions, GPT-2) (+ V·h untied head, Llama)

Active parameters count k + S experts of an MoE layer instead of E + S. FLOPs per token
(forward + backward, Narayanan et al. 2021, Eq. 3 generalized): 6·N_mm + 12·L·s·a·d,
N_mm the active parameters that multiply (every matmul weight, the head; not a lookup
table: GPT-2's tied wte counts once as the head, Llama's embed_tokens not at all), and
12·L·s·a·d the attention's QKᵀ and AV. ``convention``: "6N+12LhT" (this, the default:
what Megatron-LM and the Llama 3 paper count), "6N" (Kaplan et al. 2020), "causal"
(attention halved: a causal mask computes half the scores, as FlashAttention's kernels do).
"""
import math
from dataclasses import dataclass
from typing import Optional

FLOP_CONVENTIONS = ("6N+12LhT", "6N", "causal")


@dataclass
class Arch:
    name: str
    vocab: int
    seq: int                      # the longest sequence (block_size)
    n_layer: int
    h: int
    n_head: int
    n_kv_head: int = 0            # 0: n_head
    ffn: int = 0                  # 0: 4h (GELU) or 8h/3 rounded up to 16 (SwiGLU)
    gated: bool = False           # SwiGLU (Llama) vs GELU (GPT-2)
    tied: bool = True             # lm_head = wte (GPT-2)
    learned_pos: bool = True      # GPT-2's wpe; RoPE (Llama) has none
    bias: bool = True             # GPT-2's linear biases and LayerNorm (weight + bias)
    dropout_masks: bool = True    # Korthikanti's 1-byte masks (GPT-2 trained with dropout)
    n_expert: int = 0
    top_k: int = 2
    capacity: Optional[float] = None   # None: dropless
    expert_ffn: int = 0           # 0: ffn
    n_shared: int = 0             # shared experts (DeepSeek)
    n_dense: int = 0              # the first n_dense layers keep a dense MLP (DeepSeek-V3: 3)
    mla: tuple = ()               # multi-head latent attention (DeepSeek-V2/V3): (q_rank, kv_rank, nope, rope, v)
    window: int = 0               # sliding-window attention: keys per query (Mistral; MegaScale); 0: all
    parallel: bool = False        # attention and MLP side by side from one norm (GPT-J, PaLM, Falcon, MegaScale)

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        if not self.ffn:
            self.ffn = 16 * math.ceil(8 * self.h / 3 / 16) if self.gated else 4 * self.h
        self.expert_ffn = self.expert_ffn or self.ffn
        for k in ("vocab", "seq", "n_layer", "h", "n_head"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{self.name}: {k} must be >= 1, got {getattr(self, k)}")
        if self.h % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"{self.name}: n_embd {self.h} must divide by n_head {self.n_head}, and n_head by "
                             f"n_kv_head {self.n_kv_head}")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"{self.name}: expert_top_k must be in 1..n_expert={self.n_expert}, got {self.top_k}")

    def host_ops(self, layers, first, last, t=1):
        """pdist Function applications (each one forward op and its backward) of one micro-batch
        on one GPU: per GPT-2 block ln, linear, attention, linear, add, ln, linear, gelu, linear,
        add (10; Megatron's f and g add 4 under tp), the embeddings' wte, wpe, add (+ dropout)
        first, ln_f, head, loss last (pdist.models.gpt; the host's cost per op is
        pdist.plan.measured.host_op_cost). Llama and MoE blocks are counted as GPT-2's."""
        return len(layers) * (10 + 4 * (t > 1)) + 4 * first + 3 * last

    def host_tensors(self, layers, first, last):
        """Parameter tensors one GPU steps (GPT-2: 12 per block, wte and wpe first, ln_f last)."""
        return len(layers) * (12 if self.bias else 6) + first * (1 + self.learned_pos) + last * (
            (2 if self.bias else 1) + (not self.tied))

    head_dim = property(lambda self: self.h // self.n_head)
    # per head: the dims QKᵀ and AV contract over (MLA: nope + rope and v; else d and d)
    score_dims = property(lambda self: (self.mla[2] + self.mla[3], self.mla[4]) if self.mla else
                          (self.head_dim, self.head_dim))
    moe = property(lambda self: self.n_expert > 0)
    moe_layers = property(lambda self: self.n_layer - self.n_dense if self.n_expert else 0)

    def _mla(self, t):
        """MLA (DeepSeek-AI 2024, DeepSeek-V2 §2.1): down-projections h·r_q and h·(r_kv + rope) and
        their norms (unsplit), up-projections r_q·a(nope + rope), r_kv·a(nope + v), out a·v·h (split)."""
        rq, rkv, nope, rope, v = self.mla
        a, h = self.n_head, self.h
        up_q = rq * a * (nope + rope) if rq else h * a * (nope + rope)
        down = (h * rq + rq if rq else 0) + h * (rkv + rope) + rkv
        return (up_q + rkv * a * (nope + v) + a * v * h) // t, down

    def attn(self, t=1):
        """(split by t, unsplit) elements of one attention block on one tensor-parallel rank."""
        if self.mla:
            return self._mla(t)
        q, kv, h = self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.h
        w = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.bias else 0)       # q, k, v, o (+ qkv bias)
        return w // t, (h if self.bias else 0)                                  # o's bias is not split

    def mlp(self, f, t=1):
        """(split, unsplit) elements of one MLP of width f."""
        w = 3 * self.h * f if self.gated else 2 * self.h * f + (f if self.bias else 0)
        return w // t, (self.h if self.bias else 0)

    def norms(self):
        """A block's norm elements: two norms (one for a parallel block), weight (+ bias)."""
        return (1 if self.parallel else 2) * self.final_norm()

    def final_norm(self):
        return (2 if self.bias else 1) * self.h

    def block(self, i=0, t=1, ep=1, active=False):
        """Elements of block i on one tp rank holding E/ep experts (``active``: k + S of them)."""
        a_s, a_u = self.attn(t)
        if not self.moe or i < self.n_dense:
            m_s, m_u = self.mlp(self.ffn, t)
            return a_s + a_u + m_s + m_u + self.norms()
        e_s, e_u = self.mlp(self.expert_ffn, t)
        n = (self.top_k if active else self.n_expert // ep) + self.n_shared
        return a_s + a_u + n * (e_s + e_u) + self.h * self.n_expert + self.norms()

    def expert_elements(self, i=0, t=1, ep=1):
        """The routed experts' elements of block i on one rank (reduced over dp/ep, not dp)."""
        if not self.moe or i < self.n_dense:
            return 0
        e_s, e_u = self.mlp(self.expert_ffn, t)
        return self.n_expert // ep * (e_s + e_u)

    def embeddings(self, t=1):
        """(input embedding [+ positions], head) elements; the head is 0 when tied."""
        wte = self.vocab * self.h // t
        return wte + (self.seq * self.h if self.learned_pos else 0), (0 if self.tied else wte)

    def num_params(self, active=False):
        emb, head = self.embeddings()
        return emb + head + sum(self.block(i, active=active) for i in range(self.n_layer)) + self.final_norm()

    def matmul_params(self):
        """Active parameters that multiply a token (the head counted once, lookups left out)."""
        return self.num_params(active=True) - self.embeddings()[0] + (self.vocab * self.h if self.tied else 0)

    def flops_per_token(self, s=None, convention="6N+12LhT"):
        if convention not in FLOP_CONVENTIONS:
            raise ValueError(f"FLOP convention must be one of {FLOP_CONVENTIONS}, got {convention!r}")
        s = s or self.seq
        keys = min(s, self.window) if self.window else s                      # keys each query scores
        attn = 6 * self.n_layer * keys * self.n_head * sum(self.score_dims)   # 12·L·s·a·d without MLA
        return 6 * self.matmul_params() + {"6N+12LhT": attn, "6N": 0, "causal": attn / 2}[convention]

    def gemms(self, tokens, t=1):
        """The forward matmuls of one layer on one tp rank as (M, N, K, count, routed): M rows
        (tokens), N outputs, K inputs; the experts' rows assume uniform routing."""
        q, kv, h = self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.h
        out = [(tokens, (q + 2 * kv) // t, h, 1, False), (tokens, h, q // t, 1, False)]
        if self.mla:
            rq, rkv, nope, rope, v = self.mla
            a = self.n_head
            out = [(tokens, rq + rkv + rope, h, 1, False), (tokens, a * (nope + rope) // t, rq or h, 1, False),
                   (tokens, a * (nope + v) // t, rkv, 1, False), (tokens, h, a * v // t, 1, False)]
        f, rows, n = self.ffn, tokens, 1
        if self.moe:
            f, n = self.expert_ffn, self.n_expert
            rows = max(1, round(tokens * self.top_k * (self.capacity or 1.0) / self.n_expert))
        up = (3 if self.gated else 2) - 1
        out += [(rows, up * f // t, h, n, self.moe), (rows, h, f // t, n, self.moe)]
        if self.n_shared:
            out += [(tokens, up * f // t, h, self.n_shared, False), (tokens, h, f // t, self.n_shared, False)]
        return out


def arch_of(cfg):
    """The Arch of a pdist config (GPTConfig, LlamaConfig) or an Arch itself."""
    if isinstance(cfg, Arch):
        return cfg
    kw = dict(vocab=cfg.vocab_size, seq=cfg.block_size, n_layer=cfg.n_layer, h=cfg.n_embd, n_head=cfg.n_head,
              n_expert=getattr(cfg, "n_expert", 0), top_k=getattr(cfg, "expert_top_k", 2),
              capacity=getattr(cfg, "capacity_factor", None))
    if getattr(cfg, "model_type", "gpt2") == "llama":
        return Arch("llama", n_kv_head=cfg.n_kv_head, ffn=cfg.intermediate_size, gated=True, tied=False,
                    learned_pos=False, bias=False, dropout_masks=False, **kw)
    return Arch("gpt2", **kw)
