"""Hugging Face GPT-2 in and out: a checkpoint's parameters are already the
single-process tensors under HF GPT-2's names (``GPT2LMHeadModel.state_dict()``:
``transformer.h.0.attn.c_attn.weight``, Conv1D weights stored (in, out)), so

* ``consolidate(dir, out)`` assembles each full parameter from its saved boxes and
  writes ``out/model.safetensors`` + ``out/config.json``, which
  ``transformers.GPT2LMHeadModel.from_pretrained(out)`` loads (the tied ``lm_head.weight``
  is left out, as ``save_pretrained`` does);
* ``from_pretrained(path)`` reads a directory written by ``save_pretrained`` into a
  ``pdist.models.gpt.GPT`` (ignoring the ``attn.bias`` / ``attn.masked_bias`` mask buffers and
  the tied ``lm_head.weight``).

Neither needs MPI, torch or transformers.
"""
import json
import os

import numpy as np

from pdist.checkpoint.format import CheckpointError, read_index, read_tensors

WEIGHTS, CONFIG = "model.safetensors", "config.json"


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


def consolidate(dir, out):
    """Write checkpoint ``dir``'s parameters as a Hugging Face GPT-2 directory ``out``.
    Returns ``out``."""
    from safetensors.numpy import save_file
    index = read_index(dir)
    if index.get("config") is None:
        raise CheckpointError(f"{os.path.join(dir, 'index.json')}: no model config to write config.json from")
    params = {k: np.ascontiguousarray(v) for k, v in read_tensors(dir).items()
              if not k.startswith("optimizer.")}
    os.makedirs(out, exist_ok=True)
    save_file(params, os.path.join(out, WEIGHTS), metadata={"format": "pt"})   # HF wants format=pt
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(hf_config(index["config"]), f, indent=2)
        f.write("\n")
    return out


def from_pretrained(path, dtype=None):
    """A ``pdist.models.gpt.GPT`` with the weights of the Hugging Face GPT-2 directory ``path``
    (``config.json`` + ``model.safetensors``). ``dtype``: "float32"/"float64" (default:
    the config's ``dtype``/``torch_dtype``, else the saved weights', else float32). Dropout is 0."""
    from safetensors.numpy import load_file

    from pdist.models.gpt import GPT, GPTConfig
    with open(os.path.join(path, CONFIG)) as f:
        hf = json.load(f)
    act, eps = hf.get("activation_function", "gelu_new"), hf.get("layer_norm_epsilon", 1e-5)
    if (act not in ("gelu_new", "gelu_pytorch_tanh") or eps != 1e-5
            or hf.get("n_inner") not in (None, 4 * hf["n_embd"])
            or not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx")):
        raise ValueError(f"{path}: pdist's GPT has tanh GELU, LayerNorm eps 1e-5, a 4x MLP and attention "
                         f"scaled by 1/sqrt(d); this config has activation {act!r}, eps {eps}, "
                         f"n_inner {hf.get('n_inner')}, "
                         f"scale_attn_weights {hf.get('scale_attn_weights', True)}, "
                         f"scale_attn_by_inverse_layer_idx {hf.get('scale_attn_by_inverse_layer_idx')}")
    weights = os.path.join(path, WEIGHTS)
    if not os.path.exists(weights):
        raise FileNotFoundError(f"{weights}: not found (save_pretrained(..., safe_serialization=True) "
                                "writes it)")
    sd = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
          for k, v in load_file(weights).items()}
    floats = ("float32", "float64")
    saved = str(sd["transformer.wte.weight"].dtype) if "transformer.wte.weight" in sd else None
    dtype = dtype or next((d for d in (hf.get("dtype"), hf.get("torch_dtype"), saved) if d in floats),
                          "float32")
    cfg = GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                    n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=0.0, dtype=dtype)
    model = GPT(cfg, seed=0)
    model.load_state_dict(sd)
    return model


__all__ = ["consolidate", "from_pretrained", "hf_config"]
