"""Hugging Face Llama (``LlamaForCausalLM``) configs <-> pdist's LlamaConfig. The weights need
no conversion: pdist's Llama has HF's names and shapes (every W (out, in)), ``lm_head.weight``
included (untied). transformers 5 keeps the RoPE base in ``rope_parameters``; earlier
versions in ``rope_theta`` (and ``rope_scaling``): both are read and written."""

ROPE_KEYS = ("rope_type", "type", "rope_theta")   # anything else in rope_parameters is a scaling
# config.json's integer fields: name -> the largest value accepted (far above any real Llama)
FIELDS = {"vocab_size": 1 << 21, "max_position_embeddings": 1 << 21, "hidden_size": 1 << 16,
          "intermediate_size": 1 << 18, "num_hidden_layers": 1024, "num_attention_heads": 1024}
OPTIONAL = {"num_key_value_heads": 1024, "head_dim": 1 << 12}
IGNORE = ("rotary_emb.inv_freq",)            # buffers older checkpoints save


def hf_config(cfg):
    """LlamaConfig's fields (transformers' ``config.json``) for a pdist LlamaConfig (dict form)."""
    theta = float(cfg["rope_theta"])
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg["vocab_size"],
            "hidden_size": cfg["n_embd"], "intermediate_size": cfg["intermediate_size"],
            "num_hidden_layers": cfg["n_layer"], "num_attention_heads": cfg["n_head"],
            "num_key_value_heads": cfg["n_kv_head"], "head_dim": cfg["n_embd"] // cfg["n_head"],
            "hidden_act": "silu", "max_position_embeddings": cfg["block_size"], "rms_norm_eps": cfg["rms_norm_eps"],
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
            "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True, "pad_token_id": None,
            "bos_token_id": None, "eos_token_id": None,
            "torch_dtype": cfg["dtype"], "dtype": cfg["dtype"]}     # transformers < 5 and >= 5


def unsupported(hf):
    """What in HF Llama config ``hf`` pdist's Llama does not implement: ["field value (pdist: ...)"]."""
    out = []
    rope = dict(hf.get("rope_parameters") or {})
    if hf.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {hf['hidden_act']!r} (pdist: 'silu')")
    if hf.get("rope_scaling"):
        out.append(f"rope_scaling {hf['rope_scaling']!r} (pdist: none)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    extra = sorted(k for k in rope if k not in ROPE_KEYS)
    if kind != "default" or extra:
        out.append(f"rope_parameters {rope!r} (pdist: rope_type 'default' and rope_theta only)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(f"partial_rotary_factor {hf['partial_rotary_factor']} (pdist: 1.0)")
    for k in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if hf.get(k, False):
            out.append(f"{k} {hf[k]} (pdist: false)")
    hd, C, nh = hf.get("head_dim"), hf.get("hidden_size"), hf.get("num_attention_heads")
    if hd is not None and C and nh and hd * nh != C:
        out.append(f"head_dim {hd} (pdist: hidden_size / num_attention_heads = {C} / {nh})")
    if float(hf.get("attention_dropout", 0.0) or 0.0) != 0.0:
        out.append(f"attention_dropout {hf['attention_dropout']} (pdist: 0.0)")
    return out


def pdist_config(hf, dtype, path):
    """The LlamaConfig of HF config ``hf``, or one ValueError naming every field pdist's Llama
    does not implement."""
    from pdist.models.llama import LlamaConfig
    bad = unsupported(hf)
    if bad:
        raise ValueError(f"{path}: pdist's Llama has SiLU, default RoPE without scaling, no biases, untied "
                         "embeddings, head_dim = hidden_size / num_attention_heads and no attention dropout; "
                         "this config has " + "; ".join(bad))
    rope = hf.get("rope_parameters") or {}
    return LlamaConfig(vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"],
                       n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
                       n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                       n_embd=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                       rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                       rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)), dtype=dtype)


def pdist_names(sd):
    """HF Llama's file names are pdist's."""
    return sd


__all__ = ["FIELDS", "OPTIONAL", "IGNORE", "hf_config", "pdist_config", "pdist_names", "unsupported"]
