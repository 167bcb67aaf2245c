"""Hugging Face GPT-2 (``GPT2LMHeadModel``) configs <-> pdist's GPTConfig. The weights need
no conversion: pdist's GPT has HF GPT-2's names and Conv1D shapes (W (in, out)); the tied
``lm_head.weight`` and the ``attn.bias`` / ``attn.masked_bias`` mask buffers are not
parameters (``GPT.load_state_dict`` ignores them; ``save_pretrained`` leaves lm_head out)."""


# config.json's integer fields: name -> the largest value accepted (far above any real GPT-2; an
# absurd value fails before anything is built). n_inner may also be null.
FIELDS = {"vocab_size": 1 << 21, "n_positions": 1 << 20, "n_embd": 1 << 16, "n_layer": 1024, "n_head": 1024}
OPTIONAL = {"n_inner": 1 << 18}
IGNORE = ("lm_head.weight", ".attn.bias", ".attn.masked_bias")     # in the file, not parameters (tied, masks)


def hf_config(cfg):
    """GPT2Config's fields for a pdist GPTConfig (dict form; ``dropout`` becomes the three
    dropout probabilities, GELU is the tanh approximation ``gelu_new``)."""
    p = float(cfg["dropout"])
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg["vocab_size"],
            "n_positions": cfg["block_size"], "n_ctx": cfg["block_size"], "n_embd": cfg["n_embd"],
            "n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_inner": None,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p, "tie_word_embeddings": True,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "bos_token_id": None, "eos_token_id": None,
            "torch_dtype": cfg["dtype"], "dtype": cfg["dtype"]}     # transformers < 5 and >= 5


def pdist_config(hf, dtype, path):
    """The GPTConfig of HF GPT-2 config ``hf`` (dropout 0), or a ValueError naming what pdist's
    GPT does not implement."""
    from pdist.models.gpt import GPTConfig
    act, eps = hf.get("activation_function", "gelu_new"), hf.get("layer_norm_epsilon", 1e-5)
    if (act not in ("gelu_new", "gelu_pytorch_tanh") or eps != 1e-5
            or hf.get("n_inner") not in (None, 4 * hf["n_embd"])
            or not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx")):
        raise ValueError(f"{path}: pdist's GPT has tanh GELU, LayerNorm eps 1e-5, a 4x MLP and attention "
                         f"scaled by 1/sqrt(d); this config has activation {act!r}, eps {eps}, "
                         f"n_inner {hf.get('n_inner')}, "
                         f"scale_attn_weights {hf.get('scale_attn_weights', True)}, "
                         f"scale_attn_by_inverse_layer_idx {hf.get('scale_attn_by_inverse_layer_idx')}")
    return GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=0.0, dtype=dtype)


def pdist_names(sd):
    """HF GPT-2's file names -> pdist's (``GPT2Model`` files lack the ``transformer.`` prefix)."""
    return {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v for k, v in sd.items()}


__all__ = ["FIELDS", "OPTIONAL", "IGNORE", "hf_config", "pdist_config", "pdist_names"]
