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
from pdist.checkpoint.trust import MAX_CONFIG_BYTES, member, read_json, safetensors_header

WEIGHTS, CONFIG, SHARDS = "model.safetensors", "config.json", "model.safetensors.index.json"
CONVERTERS = {"gpt2": hf_gpt2, "llama": hf_llama}
FLOATS = ("float32", "float64")


def _converter(model_type, where):
    if model_type not in CONVERTERS:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not one pdist implements "
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


def _weight_files(path):
    """The safetensors files of a ``save_pretrained`` directory: ``model.safetensors``, or the
    shards its ``model.safetensors.index.json`` lists (plain names inside ``path`` only; links
    are followed, to regular files only: Hugging Face's cache links each file to a blob)."""
    single, shards = os.path.join(path, WEIGHTS), os.path.join(path, SHARDS)
    if os.path.lexists(single):
        return [single]
    if os.path.lexists(shards):
        wm = read_json(shards, MAX_CONFIG_BYTES, "shard index", strict=False, follow=True)
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{shards}: no 'weight_map' object")
        return [member(path, n, shards) for n in sorted(set(wm.values()))]
    raise CheckpointError(f"{single}: not found, nor {SHARDS} (save_pretrained(..., "
                          "safe_serialization=True) writes them)")


def weight_headers(path):
    """{name: (dtype, shape, file)} of every tensor in ``path``'s weight files, headers only."""
    out = {}
    for f in _weight_files(path):
        for k, (dt, shape) in safetensors_header(f, "weights file", follow=True).items():
            if k in out:
                raise CheckpointError(f"{f}: {k!r} is also in {out[k][2]}")
            out[k] = (dt, shape, f)
    return out


def read_weights(path, names=None):
    """{name: NumPy array} of a ``save_pretrained`` directory (``names``: only those), each
    file a regular file whose header was checked first."""
    from safetensors import safe_open
    by_file, out = {}, {}
    for k, (_, _, f) in weight_headers(path).items():
        if names is None or k in names:
            by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        with safe_open(f, framework="numpy") as h:
            out.update((k, h.get_tensor(k)) for k in keys)
    return out


def check_hf_config(hf, conv, where):
    """``config.json``'s integer fields are integers in [1, the converter's bound] (an absurd
    ``n_layer`` fails here, at once), its epsilons and RoPE base positive finite numbers."""
    bad = []
    for k, top in {**conv.FIELDS, **{k: v for k, v in conv.OPTIONAL.items() if hf.get(k) is not None}}.items():
        v = hf.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
            bad.append(f"{k} = {v!r} (an integer from 1 to {top:,})")
    for k in ("layer_norm_epsilon", "rms_norm_eps", "rope_theta"):
        v = hf.get(k)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf")):
            bad.append(f"{k} = {v!r} (a positive finite number)")
    if bad:
        raise CheckpointError(f"{where}: " + "; ".join(bad))


def check_shapes(cfg, heads, ignore, where):
    """The weights files hold every parameter of ``cfg`` (``param_shapes``) with its shape, as
    floats NumPy reads (float16/32/64), and nothing else but the ignored buffers."""
    want = cfg.param_shapes()
    bad = [f"{k}: file {list(heads[k][1])} vs config {list(s)}" for k, s in want.items()
           if k in heads and tuple(heads[k][1]) != tuple(s)]
    bad += [f"{k}: {heads[k][0]} (want float16, float32 or float64)" for k in want
            if k in heads and heads[k][0] not in ("float16",) + FLOATS]
    missing = [k for k in want if k not in heads]
    extra = [k for k in heads if k not in want and not any(s in k for s in ignore)]
    bad += [f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)})"] if missing else []
    bad += [f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''} ({len(extra)})"] if extra else []
    if bad:
        raise CheckpointError(f"{where}: the weights do not match config.json: " + "; ".join(bad))


def check_finite(sd, where, allow_nonfinite=False):
    """Every weight finite: else a CheckpointError naming the tensors (``allow_nonfinite``: a warning)."""
    bad = [f"{k} ({int(np.size(v) - np.count_nonzero(np.isfinite(v)))} of {np.size(v)})" for k, v in sd.items()
           if not np.isfinite(v).all()]
    if bad:
        msg = f"{where}: non-finite weights (NaN or inf) in " + ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
        if not allow_nonfinite:
            raise CheckpointError(msg + " (allow_nonfinite=True loads them with a warning)")
        import warnings
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def from_pretrained(path, dtype=None, allow_nonfinite=False):
    """A pdist model (``GPT`` or ``Llama``, by ``config.json``'s ``model_type``) with the weights
    of the Hugging Face directory ``path``. ``dtype``: "float32"/"float64" (default: the
    config's ``dtype``/``torch_dtype``, else the saved weights', else float32). Dropout is 0.
    Before anything is built: config.json (a regular file <= 16 MiB) has integer sizes in
    range (``check_hf_config``), and the weights files' headers give every parameter its
    config's shape as floats (``check_shapes``); then the weights must be finite
    (``allow_nonfinite=True``: a warning). Every failure is a CheckpointError (a ValueError)."""
    from pdist.models import registry
    path = os.fspath(path)
    where = os.path.join(path, CONFIG)
    if dtype is not None and dtype not in FLOATS:
        raise CheckpointError(f"from_pretrained(dtype={dtype!r}): want one of {FLOATS}")
    hf = read_json(where, MAX_CONFIG_BYTES, "config", strict=False, follow=True)   # HF's cache: links
    if not isinstance(hf, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    conv = _converter(hf.get("model_type"), where)
    check_hf_config(hf, conv, where)
    try:
        cfg = conv.pdist_config(hf, "float32", path)      # refuse an unsupported config before reading weights
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:    # GPTConfig/LlamaConfig: n_embd % n_head; a field of the wrong type
        raise CheckpointError(str(e) if str(e).startswith(path) else f"{where}: {e}") from None
    raw = weight_headers(path)
    rename = dict(zip(raw, conv.pdist_names(dict.fromkeys(raw))))          # file's name -> pdist's
    check_shapes(cfg, {rename[k]: h for k, h in raw.items()}, conv.IGNORE, path)
    want = cfg.param_shapes()
    sd = {rename[k]: v for k, v in read_weights(path, {k for k in raw if rename[k] in want}).items()}
    check_finite(sd, path, allow_nonfinite)
    saved = next((str(v.dtype) for v in sd.values() if str(v.dtype) in FLOATS), None)
    dtype = dtype or next((d for d in (hf.get("dtype"), hf.get("torch_dtype"), saved) if d in FLOATS), "float32")
    model = registry.build(conv.pdist_config(hf, dtype, path), seed=0)
    model.load_state_dict(sd)
    return model


__all__ = ["consolidate", "from_pretrained", "hf_config", "read_weights", "weight_headers", "check_hf_config",
           "check_shapes", "check_finite"]
