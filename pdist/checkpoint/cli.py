"""``python -m pdist.checkpoint verify DIR | inspect DIR | consolidate DIR OUT``.

``verify`` and ``inspect`` read the index and the files only: they need no MPI and
run without mpirun. ``consolidate`` writes a Hugging Face directory (pdist/checkpoint/hf.py).
"""
import sys

import numpy as np

from pdist.checkpoint.format import CheckpointError, read_index, verify
from pdist.checkpoint.validate import check_index
from pdist.checkpoint.hf import consolidate


def describe(dir):
    """What ``inspect`` prints: the step, the layout, and every tensor with its size."""
    index = read_index(dir)
    check_index(dir, index)                   # the structure only: inspect reads no rank file
    lay = index.get("layout") if isinstance(index.get("layout"), dict) else {}
    chain = lay.get("chain") if isinstance(lay.get("chain"), list) else []
    lines = [f"{dir}: pdist checkpoint v{index['version']}, step {index['step']}, "
             f"Adam step {index.get('adam_step')}",
             f"layout: world {lay.get('world_size')}, mesh {lay.get('mesh')}",
             "chain: " + " <- ".join(", ".join(f"{k}={v}" for k, v in d.items()) for d in chain if isinstance(d, dict)),
             f"config: {index.get('config')}", f"extra: {index.get('extra')}",
             f"files: {len(index['files'])}, {sum(f['bytes'] for f in index['files'].values()):,} bytes"]
    total = 0
    for name, t in index["tensors"].items():
        nbytes = int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize
        total += nbytes
        lines.append(f"  {name:60s} {str(tuple(t['shape'])):14s} {t['dtype']:8s} {nbytes:>12,} B  "
                     f"{len(t['slices'])} slice(s)")
    lines.append(f"tensors: {len(index['tensors'])}, {total:,} bytes")
    return "\n".join(lines)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m pdist.checkpoint",
                                 description="Checkpoints that load under any layout (docs/checkpoint.md).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("verify", help="check what load checks: names, file kinds and sizes, boxes, dtypes, "
                   "checksums (exit 0/1)").add_argument("dir")
    sub.add_parser("inspect", help="print the layout, step, tensors and sizes").add_argument("dir")
    c = sub.add_parser("consolidate", help="write DIR as a Hugging Face GPT-2 or Llama (model.safetensors, "
                       "config.json) in OUT")
    c.add_argument("dir")
    c.add_argument("out")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "verify":
            index = verify(a.dir)
            print(f"OK {a.dir}: step {index['step']}, {len(index['files'])} file(s), "
                  f"{len(index['tensors'])} tensors complete, checksums match (integrity, not authenticity: "
                  "docs/checkpoint.md, Trust model)")
        elif a.cmd == "inspect":
            print(describe(a.dir))
        else:
            print(f"wrote {consolidate(a.dir, a.out)}")
    except CheckpointError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    return 0


__all__ = ["describe", "main"]
