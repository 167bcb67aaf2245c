"""A Llama-family model (Touvron et al., 2023, "LLaMA"; Llama 2 and 3, Mistral's and Qwen's
dense layers) with Hugging Face ``LlamaForCausalLM``'s names and shapes.

    x_0 = embed_tokens[idx]                                       # (B, T, C), no position table
    h   = x_l + o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))),  n = input_layernorm(x_l)
    x_{l+1} = h + down_proj(silu(gate_proj(m)) * up_proj(m)),      m = post_attention_layernorm(h)
    logits = lm_head(norm(x_L))                                   # (B, T, V), untied

RMSNorm (eps ``rms_norm_eps``), rotary position embeddings on q and k (base ``rope_theta``,
HF's rotate_half convention, positions 0..T-1 of the whole sequence), grouped-query
attention (``n_kv_head`` key/value heads, each serving n_head / n_kv_head query heads),
a SwiGLU MLP of width ``intermediate_size``, no biases, no dropout.

Parameter names and shapes, as HF's (every Linear stores W (out, in): ``layout="out_in"``,
so a ``save_pretrained`` file loads without transposes): ``model.embed_tokens.weight`` (V, C);
``model.layers.{i}.self_attn.q_proj.weight`` (n_head hd, C), ``k_proj``/``v_proj``
(n_kv_head hd, C), ``o_proj`` (C, n_head hd); ``model.layers.{i}.mlp.gate_proj.weight``,
``up_proj`` (I, C), ``down_proj`` (C, I); ``model.layers.{i}.input_layernorm.weight``,
``post_attention_layernorm.weight`` (C,); ``model.norm.weight`` (C,); ``lm_head.weight`` (V, C).
With ``n_expert`` = E > 0 the MLP is a mixture of experts (pdist/models/moe.py; Qwen2-MoE's
names): ``...mlp.gate.weight`` (E, C), ``...mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``.

Init: every weight N(0, 0.02^2) (HF's initializer_range), the norms 1, each from its own
generator seeded by (seed, crc32(name)) -- ``llama_init`` (pdist.models.causal_lm).
"""
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from pdist import nn
from pdist.engine import attention
from pdist.engine import functional as F
from pdist.engine.recompute import MODES, checkpoint
from pdist.models.causal_lm import ZEROS, CausalLM, CrossEntropyLoss, check_device, init_stream, normal_init
from pdist.models.llama_plan import llama_plan
from pdist.models.moe import MoE, check_moe_config

STD = 0.02  # HF LlamaConfig.initializer_range


@dataclass
class LlamaConfig:
    vocab_size: int = 96
    block_size: int = 32              # the longest sequence (HF: max_position_embeddings)
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: Optional[int] = None     # key/value heads; None: n_head (multi-head attention)
    n_embd: int = 64
    intermediate_size: Optional[int] = None  # the SwiGLU width; None: 8/3 n_embd rounded up to 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    dropout: float = 0.0              # must be 0: Llama has no dropout (kept so generic checks read it)
    dtype: str = "float32"
    recompute: str = "none"           # "none" | "selective" | "full": pdist/engine/recompute.py
    n_expert: int = 0                 # 0: the dense MLP; E > 0: an MoE MLP of E SwiGLU experts (models/moe.py)
    expert_top_k: int = 2             # experts per token
    capacity_factor: Optional[float] = None   # None: dropless; c: each expert takes ceil(c N k / E) rows
    router_aux_loss_coef: float = 0.01        # the load-balancing loss's weight (Switch)
    model_type: ClassVar[str] = "llama"   # Hugging Face's name (not a field)

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 16 * math.ceil(8 * self.n_embd / 3 / 16)
        problems = self.problems()
        if problems:
            raise ValueError("LlamaConfig: " + "; ".join(problems))

    def problems(self):
        """Every field that pdist's Llama cannot build, with what to change."""
        out = [f"{k} must be >= 1, got {getattr(self, k)}" for k in
               ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size")
               if int(getattr(self, k)) < 1]
        if out:
            return out
        if self.n_embd % self.n_head:
            out.append(f"n_embd = {self.n_embd} must be divisible by n_head = {self.n_head} (head_dim = n_embd / n_head)")
        elif self.head_dim % 2:
            out.append(f"head_dim = n_embd / n_head = {self.head_dim} must be even (rotary embeddings turn pairs)")
        if self.n_head % self.n_kv_head:
            out.append(f"n_head = {self.n_head} must be a multiple of n_kv_head = {self.n_kv_head} "
                       "(each kv head serves n_head / n_kv_head query heads)")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            out.append(f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta ({self.rope_theta}) must be > 0")
        if self.dropout != 0:
            out.append(f"dropout must be 0.0 (Llama has no dropout), got {self.dropout}")
        if self.dtype not in ("float32", "float64"):
            out.append(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.recompute not in MODES:
            out.append(f"recompute must be one of {MODES}, got {self.recompute!r}")
        return out + check_moe_config(self)

    head_dim = property(lambda self: self.n_embd // self.n_head)

    def param_shapes(self):
        """name -> shape of every parameter, in the model's (and HF's) order."""
        V, C, I = self.vocab_size, self.n_embd, self.intermediate_size
        q, kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        shapes = {"model.embed_tokens.weight": (V, C)}
        for i in range(self.n_layer):
            h = f"model.layers.{i}."
            shapes.update({h + "self_attn.q_proj.weight": (q, C), h + "self_attn.k_proj.weight": (kv, C),
                           h + "self_attn.v_proj.weight": (kv, C), h + "self_attn.o_proj.weight": (C, q)})
            mlps = [h + "mlp."] if not self.n_expert else [h + f"mlp.experts.{e}." for e in range(self.n_expert)]
            if self.n_expert:
                shapes[h + "mlp.gate.weight"] = (self.n_expert, C)
            for m in mlps:
                shapes.update({m + "gate_proj.weight": (I, C), m + "up_proj.weight": (I, C), m + "down_proj.weight": (C, I)})
            shapes.update({h + "input_layernorm.weight": (C,), h + "post_attention_layernorm.weight": (C,)})
        shapes.update({"model.norm.weight": (C,), "lm_head.weight": (V, C)})
        return shapes

    def num_params(self):
        """Ψ: the number of parameters (embed_tokens and lm_head counted apart: untied)."""
        return sum(math.prod(s) for s in self.param_shapes().values())

    def parallel_plan(self):
        """How each layer is cut by the strategies (pdist/models/llama_plan.py)."""
        return llama_plan(self)


def llama_init(cfg, name, seed):
    """The full float64 value of parameter ``name`` for (cfg, seed): the norms 1, every
    weight N(0, 0.02^2) from its own generator. Any layout can call it and slice its shard."""
    shape = cfg.param_shapes()[name]
    return np.ones(shape) if name.endswith("norm.weight") else normal_init(shape, name, seed, STD)


def llama_init_stream(cfg, name, seed):
    """``llama_init(cfg, name, seed)`` as a row stream (bit-identical, drawn in chunks)."""
    shape = cfg.param_shapes()[name]
    return init_stream(shape, name, seed, const=1.0) if name.endswith("norm.weight") \
        else init_stream(shape, name, seed, std=STD)


def _linear(n_in, n_out):
    return nn.Linear(n_in, n_out, bias=False, rng=ZEROS, layout="out_in")


class LlamaAttention(nn.Module):
    """o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x))). ``n_head`` and
    ``n_kv_head`` are the heads this module holds (tensor parallelism divides both). With
    recompute="selective" the core (RoPE, QK^T, softmax, x V) is checkpointed."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.rope_theta, self.selective = cfg.rope_theta, cfg.recompute == "selective"
        C, hd = cfg.n_embd, cfg.head_dim
        self.q_proj = _linear(C, cfg.n_head * hd)
        self.k_proj = _linear(C, cfg.n_kv_head * hd)
        self.v_proj = _linear(C, cfg.n_kv_head * hd)
        self.o_proj = _linear(cfg.n_head * hd, C)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, nh hd), (B, T, nkv hd) x 2
        return self.o_proj(checkpoint(self.core, q, k, v) if self.selective else self.core(q, k, v))

    context = None  # context parallelism's attention (pdist/parallel/context/context_parallel.py), or None

    def core(self, q, k, v):
        pos = None if self.context is None else self.context.positions  # global positions under CP
        q = F.apply_rotary(q, self.head_dim, self.rope_theta, positions=pos)
        k = F.apply_rotary(k, self.head_dim, self.rope_theta, positions=pos)
        if self.context is not None:
            return self.context(q, k, v, n_head=self.n_head, n_kv_head=self.n_kv_head)
        return attention.causal_attention(q, k, v, self.n_head, self.n_kv_head)  # (B, T, nh hd)


class LlamaMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)): C -> intermediate_size -> C."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = _linear(cfg.n_embd, cfg.intermediate_size)
        self.up_proj = _linear(cfg.n_embd, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, cfg.n_embd)

    def forward(self, x):
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.)). With
    recompute="full" the whole body is checkpointed (only the block's input is kept)."""

    def __init__(self, cfg):
        super().__init__()
        self.full_recompute = cfg.recompute == "full"
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg) if not cfg.n_expert else MoE(
            _linear(cfg.n_embd, cfg.n_expert), [LlamaMLP(cfg) for _ in range(cfg.n_expert)],
            cfg.expert_top_k, cfg.capacity_factor, cfg.router_aux_loss_coef)
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps)

    def forward(self, x):
        return checkpoint(self.body, x) if self.full_recompute else self.body(x)

    def body(self, x):
        x = x + self.self_attn(self.input_layernorm(x))  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd, rng=ZEROS)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.rms_norm_eps)


class Llama(CausalLM):
    """``Llama(cfg, seed)``: every weight drawn by llama_init; see the module docstring.
    ``device="meta"``: shapes only, filled later from ``init_rows`` (as GPT)."""

    def __init__(self, cfg, seed=0, device=None):
        check_device(device, "Llama")
        super().__init__()
        self.config, self.seed = cfg, seed
        self.model = LlamaModel(cfg)
        self.lm_head = _linear(cfg.n_embd, cfg.vocab_size)
        self.init_parameters(device)
        self.loss_fn = CrossEntropyLoss()

    blocks = property(lambda self: self.model.layers)

    def init_value(self, name):
        return llama_init(self.config, name, self.seed)

    def init_stream(self, name):
        return llama_init_stream(self.config, name, self.seed)

    def embed(self, idx):
        """x_0 = embed_tokens[idx] -> (B, T, C)"""
        return self.model.embed_tokens(self.tokens(idx))

    def head(self, x):
        """logits = lm_head(norm(x)) -> (B, T, V)"""
        return self.lm_head(self.model.norm(x))

    def load_state_dict(self, state_dict, strict=True, ignore=("rotary_emb.inv_freq",)):
        """HF's rotary ``inv_freq`` buffers (older checkpoints save them) are ignored."""
        return super().load_state_dict(state_dict, strict=strict, ignore=ignore)


__all__ = ["LlamaConfig", "Llama", "llama_init", "llama_init_stream", "LlamaAttention", "LlamaMLP",
           "LlamaDecoderLayer"]
