"""GPT-2 (Radford et al., 2019) with Hugging Face's state_dict names and shapes.

    x_0 = wte[idx] + wpe[0..T)                                   # (B, T, C)
    x_{l+1/2} = x_l + c_proj(attn(ln_1(x_l)))                    # causal, n_head heads
    x_{l+1}   = x_{l+1/2} + mlp.c_proj(gelu(mlp.c_fc(ln_2(x_{l+1/2}))))
    logits = ln_f(x_L) @ wte^T                                   # (B, T, V), lm_head tied to wte

Parameter names: ``transformer.wte.weight`` (V, C), ``transformer.wpe.weight``
(block_size, C), ``transformer.h.{i}.ln_1.weight/bias``,
``...attn.c_attn.weight`` (C, 3C) / ``.bias`` (3C), ``...attn.c_proj.weight`` (C, C),
``...ln_2``, ``...mlp.c_fc.weight`` (C, 4C), ``...mlp.c_proj.weight`` (4C, C),
``transformer.ln_f.weight/bias``. With ``n_expert`` = E > 0 the MLP is a mixture of experts
(pdist/models/moe.py): ``...mlp.gate.weight`` (C, E), ``...mlp.experts.{e}.c_fc``/``c_proj``
as the dense MLP's. The tied ``lm_head.weight`` is not a separate
parameter; ``load_state_dict`` ignores it and GPT-2's ``attn.bias`` mask buffers.

Tensor and pipeline parallelism transform this one model (pdist.parallel): TP
swaps its Linear/Embedding layers, its head and its loss for the parallel ones;
a pipeline stage keeps its blocks (and the first/last stage the embedding/head).
So ``forward`` is written in the parts they replace: ``embed`` (wte, wpe,
dropout), the blocks, ``lm_head`` (x wte^T, tied) and ``loss_fn``.

Init (GPT-2's): weights N(0, 0.02), the two residual projections
N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm 1 and 0; each parameter from
its own generator seeded by (seed, crc32(name)) -- ``gpt_init``.
"""
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from pdist import nn
from pdist.engine import attention, precision
from pdist.engine import functional as F
from pdist.engine.backend import xp
from pdist.engine.recompute import check_mode, checkpoint
from pdist.models.causal_lm import ZEROS as _ZEROS
from pdist.models.causal_lm import CausalLM, CrossEntropyLoss, check_device, init_stream, normal_init
from pdist.models.gpt_plan import gpt_plan
from pdist.models.moe import MoE, check_moe_config


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    dtype: str = "float32"
    recompute: str = "none"     # "none" | "selective" | "full": pdist/engine/recompute.py, docs/recompute.md
    n_expert: int = 0           # 0: the dense MLP; E > 0: an MoE MLP of E GELU experts (pdist/models/moe.py)
    expert_top_k: int = 2       # experts per token
    capacity_factor: Optional[float] = None   # None: dropless; c: each expert takes ceil(c N k / E) rows
    router_aux_loss_coef: float = 0.01        # the load-balancing loss's weight (Switch)
    model_type: ClassVar[str] = "gpt2"   # Hugging Face's name (not a field: not in asdict, not in checkpoints' config)

    def __post_init__(self):
        for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"GPTConfig.{k} must be >= 1, got {getattr(self, k)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"GPTConfig.dtype must be 'float32' or 'float64', got {self.dtype!r}")
        check_mode(self.recompute)
        problems = check_moe_config(self)
        if problems:
            raise ValueError("GPTConfig: " + "; ".join(problems))

    def param_shapes(self):
        """name -> shape of every parameter, in the model's order."""
        V, T, C = self.vocab_size, self.block_size, self.n_embd
        shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}
        for i in range(self.n_layer):
            h = f"transformer.h.{i}."
            shapes.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
                           h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
                           h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                           h + "ln_2.weight": (C,), h + "ln_2.bias": (C,)})
            mlps = [h + "mlp."] if not self.n_expert else [h + f"mlp.experts.{e}." for e in range(self.n_expert)]
            if self.n_expert:
                shapes[h + "mlp.gate.weight"] = (C, self.n_expert)
            for m in mlps:
                shapes.update({m + "c_fc.weight": (C, 4 * C), m + "c_fc.bias": (4 * C,),
                               m + "c_proj.weight": (4 * C, C), m + "c_proj.bias": (C,)})
        shapes.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)})
        return shapes

    def num_params(self):
        """Ψ: the number of parameters (the tied lm_head counted once, as wte)."""
        return sum(math.prod(s) for s in self.param_shapes().values())

    def parallel_plan(self):
        """How each layer is cut by the strategies (pdist/models/gpt_plan.py)."""
        return gpt_plan(self)


def _gpt_std(cfg, name):
    return 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02


def gpt_init(cfg, name, seed):
    """The full float64 NumPy value of parameter ``name`` for (cfg, seed).
    Depends on nothing else: any layout can call it and slice its shard."""
    shape = cfg.param_shapes()[name]
    if name.endswith("bias"):
        return np.zeros(shape)
    if ".ln_" in name:
        return np.ones(shape)
    return normal_init(shape, name, seed, _gpt_std(cfg, name))


def gpt_init_stream(cfg, name, seed):
    """``gpt_init(cfg, name, seed)`` as a row stream (pdist.engine.meta.RowStream): rows [a, b)
    drawn in chunks, bit-identical to the whole array (a Generator's normals come in
    the same order however many are asked at a time)."""
    shape = cfg.param_shapes()[name]
    if name.endswith("bias") or ".ln_" in name:
        return init_stream(shape, name, seed, const=0.0 if name.endswith("bias") else 1.0)
    return init_stream(shape, name, seed, std=_gpt_std(cfg, name))


def causal_self_attention(qkv, n_head):
    """Multi-head causal self-attention, heads batched (no loop over heads):
    q, k, v = split(x W_qkv + b);  y_h = softmax(q_h k_h^T / sqrt(d) + M) v_h;
    out = concat_h(y_h) W_o + b_o. ``n_head`` is the number of heads this module
    holds (a tensor-parallel rank holds n_head / tp of them). qkv: (B, T, 3 n_head hs).
    One fused Function (pdist.engine.attention): q, k, v stay views of qkv, no head transposes."""
    return attention.causal_self_attention(qkv, n_head)  # (B, T, C)


class Attention(nn.Module):
    """c_proj(core(c_attn(x))). With recompute="selective" the core (QK^T, softmax, x V)
    is checkpointed: its (B, nh, T, T) arrays are recomputed in backward, not kept
    (Korthikanti et al., 2022, "selective activation recomputation")."""
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.selective = cfg.n_head, cfg.recompute == "selective"
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, rng=_ZEROS)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, rng=_ZEROS)

    context = None  # context parallelism's attention (pdist/parallel/context/context_parallel.py), or None

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3C)
        core = causal_self_attention if self.context is None else self._context_core
        if self.selective:
            return self.c_proj(checkpoint(core, qkv, self.n_head))
        return self.c_proj(core(qkv, self.n_head))


    def _context_core(self, qkv, n_head):
        return self.context(qkv, n_head=n_head)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, rng=_ZEROS)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, rng=_ZEROS)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(.)). With recompute="full" the whole body is
    checkpointed: only the block's input is kept, the rest is recomputed in backward."""
    def __init__(self, cfg):
        super().__init__()
        self.full_recompute = cfg.recompute == "full"
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg) if not cfg.n_expert else MoE(
            nn.Linear(cfg.n_embd, cfg.n_expert, bias=False, rng=_ZEROS), [MLP(cfg) for _ in range(cfg.n_expert)],
            cfg.expert_top_k, cfg.capacity_factor, cfg.router_aux_loss_coef)

    def forward(self, x):
        return checkpoint(self.body, x) if self.full_recompute else self.body(x)

    def body(self, x):
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, rng=_ZEROS)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, rng=_ZEROS)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)


class LMHead(nn.Module):
    """logits = x W^T with W = wte (tied): (B, T, C) -> (B, T, V). ``weight`` is the
    embedding's own Parameter (so it is listed once, as ``transformer.wte.weight``),
    or, on a pipeline's last stage, a copy kept equal to it (``lm_head.weight``)."""

    layout, bias = "out_in", None      # W stored (V, C): y = x W^T (what tensor parallelism cuts)

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return precision.linear(x, self.weight.T)  # (B, T, V)


class GPT(CausalLM):
    """GPT-2; see the module docstring. ``GPT(cfg, seed)`` draws every weight with gpt_init.

    ``device="meta"``: shapes only (pdist.engine.meta.MetaArray, no memory); a strategy fills
    this rank's pieces from ``init_rows`` (FSDP's meta-device init), or ``materialize()``."""

    def __init__(self, cfg, seed=0, device=None):
        check_device(device, "GPT")
        super().__init__()
        self.config, self.seed = cfg, seed
        self.transformer = Transformer(cfg)
        self.drop = nn.Dropout(cfg.dropout, seed=seed)
        self.init_parameters(device)
        self.lm_head = LMHead(self.transformer.wte.weight)
        self.loss_fn = CrossEntropyLoss()

    blocks = property(lambda self: self.transformer.h)

    def init_value(self, name):
        return gpt_init(self.config, name, self.seed)

    def init_stream(self, name):
        return gpt_init_stream(self.config, name, self.seed)

    def embed(self, idx):
        """x_0 = drop(wte[idx] + wpe[0..T)) -> (B, T, C)"""
        idx = self.tokens(idx)
        T = idx.shape[-1]
        return self.drop(self.transformer.wte(idx) + self.transformer.wpe(xp.arange(T)))  # (B, T, C)

    def head(self, x):
        """logits = ln_f(x) wte^T -> (B, T, V)"""
        return self.lm_head(self.transformer.ln_f(x))

    def load_state_dict(self, state_dict, strict=True, ignore=("lm_head.weight", ".attn.bias",
                                                               ".attn.masked_bias")):
        return super().load_state_dict(state_dict, strict=strict, ignore=ignore)
