"""Llama's parallel plan (pdist/models/plan.py): how each of its layers is cut.

Per block under tensor parallelism over t ranks (Megatron-LM's cut of a Llama block):
``q_proj``, ``k_proj`` and ``v_proj`` are column-parallel by heads (rank i: query heads
[i nh/t, (i+1) nh/t) and key/value heads [i nkv/t, (i+1) nkv/t), so each rank's query
heads find their grouped key/value heads on the same rank) and read one input through one
f, as Megatron's fused QKV GEMM; ``o_proj`` is row-parallel. The SwiGLU MLP's ``gate_proj``
and ``up_proj`` are column-parallel on one shared input, ``down_proj`` row-parallel. The
embedding is vocab-parallel; the untied ``lm_head`` is column-parallel over the vocabulary
and the loss the vocab-parallel cross-entropy. Under sequence parallelism the RMSNorm
weights get partial gradients; rotary positions need nothing (attention sees the whole
sequence); under context parallelism the ``heads`` modules get the cross-rank attention and
RoPE turns by the global positions of this rank's tokens (pdist/parallel/context/context_parallel.py). A pipeline runs ``embed`` first and ``head`` last (nothing tied). ZeRO's units
are the blocks and the final norm; the embedding and the head form the root.
With ``n_expert`` > 0 each block's ``mlp`` is an MoE layer (``experts``); tensor parallelism
leaves it whole (its gate and experts replicated over tp; expert parallelism splits the experts).
"""
from pdist.models.plan import Column, Experts, ModelPlan, PipelinePlan, Row, Vocab, VocabLoss

BLOCK = "model.layers.*"


def llama_plan(cfg):
    """The ModelPlan of a LlamaConfig."""
    qkv, gate_up = Column(shared_input="qkv"), Column(shared_input="gate_up")
    return ModelPlan(
        tensor={f"{BLOCK}.self_attn.q_proj": qkv, f"{BLOCK}.self_attn.k_proj": qkv,
                f"{BLOCK}.self_attn.v_proj": qkv, f"{BLOCK}.self_attn.o_proj": Row(),
                **({} if cfg.n_expert else {f"{BLOCK}.mlp.gate_proj": gate_up, f"{BLOCK}.mlp.up_proj": gate_up,
                                            f"{BLOCK}.mlp.down_proj": Row()}),
                "model.embed_tokens": Vocab(), "lm_head": Column(), "loss_fn": VocabLoss()},
        heads={f"{BLOCK}.self_attn": ("n_head", "n_kv_head")},
        tp_sizes={"n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "intermediate_size": cfg.intermediate_size,
                  "vocab_size": cfg.vocab_size},
        sequence_partial=(f"{BLOCK}.input_layernorm.weight", f"{BLOCK}.post_attention_layernorm.weight",
                          "model.norm.weight"),
        pipeline=PipelinePlan(blocks="model.layers", first="embed", last="head",
                              first_modules=("model.embed_tokens",), last_modules=("model.norm", "lm_head"),
                              loss="loss_fn", hidden=cfg.n_embd),
        zero_units=(BLOCK, "model.norm"),
        experts={f"{BLOCK}.mlp": Experts(cfg.n_expert)} if cfg.n_expert else {})


__all__ = ["llama_plan"]
