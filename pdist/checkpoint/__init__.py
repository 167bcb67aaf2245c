"""Checkpoints that load under any layout (docs/checkpoint.md).

    sharded.py   load: each rank's pieces as boxes of the single-process tensors, read
                 back by box intersection under any layout
    writer.py    save: every rank writes its pieces, rank 0 the index, then the swap into place
    owner.py     what save owns on disk: the lock, temporary and aside names, cleanup of dead saves
    runs.py      run ids, keep= (prune), latest, save's argument and path checks
    cli.py       python -m pdist.checkpoint, and describe (what inspect prints)
    format.py    the index, safetensors files, checksums, verify
    validate.py  what a checkpoint must be before anything is read (verify and load run it)
    trust.py     reading a stranger's files: names inside the directory, regular files, bounded reads
    hf.py        Hugging Face in and out: from_pretrained, consolidate (GPT-2 or Llama, by model_type)
    hf_gpt2.py, hf_llama.py   each model's config.json <-> pdist config

    python -m pdist.checkpoint verify DIR | inspect DIR | consolidate DIR OUT
"""
from pdist.checkpoint.cli import describe
from pdist.checkpoint.format import CheckpointError, verify
from pdist.checkpoint.hf import consolidate, from_pretrained
from pdist.checkpoint.sharded import latest, load, prune, save

__all__ = ["save", "load", "latest", "prune", "verify", "describe", "consolidate", "from_pretrained",
           "CheckpointError"]
