"""Hugging Face in and out, for every model pdist has: a checkpoint's parameters are already the
single-process tensors under HF's names (GPT-2: ``GPT2LMHeadModel``'s, Conv1D weights (in,
out); Llama: ``LlamaForCausalLM``'s, weights (out, in)), so

* ``consolidate(dir, out)`` assembles each full parameter from its saved boxes and writes
  ``out/model.safetensors`` + ``out/config.json``, which ``transformers.GPT2LMHeadModel`` /
  ``LlamaForCausalLM.from_pretrained(out)`` loads. The index's ``model_type`` says which
  (a checkpoint written before pdist had Llama has none: GPT-2);
* ``from_pretrained(path, dtype=None)`` reads a directory written by ``save_pretrained``
  (``config.json``, ``model.safetensors`` or its shards) into a pdist model, chosen by the
  config's ``model_type``; a config pdist's model does not implement is refused, naming
  the fields.

The per-model config conversions: hf_gpt2.py, hf_llama.py. Neither direction needs MPI,
torch or transformers.
"""
import json
import os

import numpy as np

from pdist.checkpoint import hf_gpt2, hf_llama
from pdist.checkpoint.format import CheckpointError, model_type_of, read_index, read_tensors

WEIGHTS, CONFIG, SHARDS = "model.safetensors", "config.json", "model.safetensors.index.json"
CONVERTERS = {"gpt2": hf_gpt2, "llama": hf_llama}
FLOATS = ("float32", "float64")


def _converter(model_type, where):
    if model_type not in CONVERTERS:
        raise ValueError(f"{where}: model_type {model_type!r} is not one pdist implements "
                         f"({', '.join(sorted(CONVERTERS))})")
    return CONVERTERS[model_type]


def hf_config(cfg, model_type="gpt2"):
    """The Hugging Face ``config.json`` fields for a pdist config (dict form, as in the index)."""
    return _converter(model_type, "hf_config").hf_config(cfg)


def consolidate(dir, out):
    """Write checkpoint ``dir``'s parameters as a Hugging Face directory ``out`` (GPT-2 or
    Llama, as the index says). Returns ``out``."""
    from safetensors.numpy import save_file
    index = read_index(dir)
    if index.get("config") is None:
        raise CheckpointError(f"{os.path.join(dir, 'index.json')}: no model config to write config.json from")
    conv = _converter(model_type_of(index), os.path.join(dir, "index.json"))
    params = {k: np.ascontiguousarray(v) for k, v in read_tensors(dir).items()
              if not k.startswith("optimizer.")}
    os.makedirs(out, exist_ok=True)
    save_file(params, os.path.join(out, WEIGHTS), metadata={"format": "pt"})   # HF wants format=pt
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(conv.hf_config(index["config"]), f, indent=2)
        f.write("\n")
    return out


def read_weights(path):
    """{name: NumPy array} of a ``save_pretrained`` directory: ``model.safetensors``, or the
    shards its ``model.safetensors.index.json`` lists."""
    from safetensors.numpy import load_file
    single, shards = os.path.join(path, WEIGHTS), os.path.join(path, SHARDS)
    if os.path.exists(single):
        return load_file(single)
    if os.path.exists(shards):
        with open(shards) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for name in files for k, v in load_file(os.path.join(path, name)).items()}
    raise FileNotFoundError(f"{single}: not found, nor {SHARDS} (save_pretrained(..., "
                            "safe_serialization=True) writes them)")


def from_pretrained(path, dtype=None):
    """A pdist model (``GPT`` or ``Llama``, by ``config.json``'s ``model_type``) with the weights
    of the Hugging Face directory ``path``. ``dtype``: "float32"/"float64" (default: the
    config's ``dtype``/``torch_dtype``, else the saved weights', else float32). Dropout is 0."""
    from pdist.models import registry
    with open(os.path.join(path, CONFIG)) as f:
        hf = json.load(f)
    conv = _converter(hf.get("model_type"), os.path.join(path, CONFIG))
    conv.pdist_config(hf, "float32", path)              # refuse an unsupported config before reading weights
    sd = conv.pdist_names(read_weights(path))
    saved = next((str(v.dtype) for v in sd.values() if str(v.dtype) in FLOATS), None)
    dtype = dtype or next((d for d in (hf.get("dtype"), hf.get("torch_dtype"), saved) if d in FLOATS), "float32")
    model = registry.build(conv.pdist_config(hf, dtype, path), seed=0)
    model.load_state_dict(sd)
    return model


__all__ = ["consolidate", "from_pretrained", "hf_config", "read_weights"]
