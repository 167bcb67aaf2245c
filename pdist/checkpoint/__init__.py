"""Checkpoints that load under any layout (docs/checkpoint.md).

    sharded.py   save, load, latest, prune, describe: each rank's pieces as boxes of the
                 single-process tensors, read back by box intersection under any layout
    format.py    the index, safetensors files, checksums, verify
    hf.py        Hugging Face in and out: from_pretrained, consolidate (GPT-2 or Llama, by model_type)
    hf_gpt2.py, hf_llama.py   each model's config.json <-> pdist config

    python -m pdist.checkpoint verify DIR | inspect DIR | consolidate DIR OUT
"""
from pdist.checkpoint.format import CheckpointError, verify
from pdist.checkpoint.hf import consolidate, from_pretrained
from pdist.checkpoint.sharded import describe, latest, load, prune, save

__all__ = ["save", "load", "latest", "prune", "verify", "describe", "consolidate", "from_pretrained",
           "CheckpointError"]
