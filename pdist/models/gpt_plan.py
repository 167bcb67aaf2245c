"""GPT-2's parallel plan (pdist/models/plan.py): how each of its layers is cut.

Per block under tensor parallelism over t ranks (Megatron-LM, Shoeybi et al. 2019): the
fused ``attn.c_attn`` [Q | K | V] is column-parallel with stride 3 (each of Q, K, V split
by heads), ``attn.c_proj`` row-parallel; ``mlp.c_fc`` column, ``mlp.c_proj`` row. The
embedding ``wte`` is vocab-parallel and the tied head shares its shard, so the logits are
(B, T, V/t) and the loss is the vocab-parallel cross-entropy. Under sequence parallelism
``wpe`` and the dropout hold T/t tokens, and the replicated parameters (LayerNorms, the
row-parallel biases, ``wpe``) get partial gradients. A pipeline runs ``embed`` first and
``head`` last; the last stage's ``lm_head.weight`` is its copy of the tied ``wte``. ZeRO's
units are the blocks and ``ln_f``; ``wte`` and ``wpe`` form the root. Under context
parallelism (pdist/parallel/context/context_parallel.py) the ``heads`` modules are the attention
that goes across the cp ranks, and ``wpe`` (a PositionShard) reads the global positions of
this rank's tokens.
With ``n_expert`` > 0 each block's ``mlp`` is an MoE layer (``experts``); tensor parallelism
leaves it whole (its gate and experts replicated over tp; expert parallelism splits the experts).
"""
from pdist.models.plan import Column, Experts, DropoutShard, ModelPlan, PipelinePlan, PositionShard, Row, Vocab, VocabLoss

BLOCK = "transformer.h.*"


def gpt_plan(cfg):
    """The ModelPlan of a GPTConfig."""
    return ModelPlan(
        tensor={f"{BLOCK}.attn.c_attn": Column(stride=3), f"{BLOCK}.attn.c_proj": Row(),
                **({} if cfg.n_expert else {f"{BLOCK}.mlp.c_fc": Column(), f"{BLOCK}.mlp.c_proj": Row()}),
                "transformer.wte": Vocab(), "lm_head": Column(tied_to="transformer.wte"),
                "loss_fn": VocabLoss()},
        heads={f"{BLOCK}.attn": ("n_head",)},
        tp_sizes={"n_head": cfg.n_head, "n_embd": cfg.n_embd, "4*n_embd": 4 * cfg.n_embd,
                  "vocab_size": cfg.vocab_size},
        sequence={"transformer.wpe": PositionShard(), "drop": DropoutShard()},
        sequence_partial=(f"{BLOCK}.ln_1.*", f"{BLOCK}.ln_2.*", "transformer.ln_f.*",
                          f"{BLOCK}.attn.c_proj.bias", f"{BLOCK}.mlp.c_proj.bias", "transformer.wpe.weight"),
        pipeline=PipelinePlan(blocks="transformer.h", first="embed", last="head",
                              first_modules=("transformer.wte", "transformer.wpe"),
                              last_modules=("transformer.ln_f", "lm_head"), loss="loss_fn",
                              tied={"lm_head.weight": "transformer.wte.weight"}, hidden=cfg.n_embd),
        zero_units=(BLOCK, "transformer.ln_f"),
        experts={f"{BLOCK}.mlp": Experts(cfg.n_expert)} if cfg.n_expert else {})


__all__ = ["gpt_plan"]
