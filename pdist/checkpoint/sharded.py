"""Checkpoints that load under any layout (docs/checkpoint.md).

A checkpoint written as "rank 3's optimizer state" only loads on the same layout: rank 3
of another mesh holds other pieces. Every pdist strategy already says where each piece
of each single-process tensor lives (``model.pieces()``: name, global shape, offsets), so
each rank saves its pieces as boxes of the single-process tensors and an index records
which file holds which box. Loading under any layout is then box intersection: each rank
reads, memory-mapped, only the parts of saved boxes that overlap the pieces it holds.

    from pdist import checkpoint
    checkpoint.save(model, opt, "ckpt/step-000100", step=100, extra={"seed": 0}, keep=3)
    step, extra = checkpoint.load(model, opt, "ckpt/step-000100")    # any layout, any world size
    train(model, opt, get_batch, steps - step, start=step)

    python -m pdist.checkpoint verify DIR | inspect DIR | consolidate DIR OUT   (cli.py)

Both are collective over ``model.span_group()`` (the world; a plain model, such as a
``GPT``, is one process: ``Local(model)``). ``save`` writes into a
temporary sibling directory and renames it into place after every rank has fsynced its
file, so a crash leaves the previous checkpoint whole. ``load`` checks the index, the
config, the files' sizes and checksums and reads every piece into new arrays; only when
every rank succeeded does it copy them in, else every rank raises the same
``CheckpointError``. Parameters and Adam's m, v and step are restored exactly (bit for bit).

Mixed precision (``parallelize(..., precision="bf16"/"fp16")``): ``MixedPrecision.pieces()``
are cut out of the fp32 masters, so the files hold the masters W and Adam's m, v (fp32) and
never the low-precision weights; loading restores W and ``after_load`` re-derives
w = round(W). fp16's GradScaler state (scale, growth tracker) goes into the index.
"""
import json
import os
import re
import secrets
import shutil

import numpy as np

from pdist.engine.backend import to_numpy, xp
from pdist.checkpoint.format import (FORMAT, INDEX, VERSION, CheckpointError, Reader, fsync_dir,
                                     model_record, model_type_of, piece_key, rank_file, read_index, verify,
                                     write_file, write_safetensors)
from pdist.checkpoint.validate import check_model, check_scaler, validate
from pdist.checkpoint.hf import consolidate, from_pretrained

STATES = ("exp_avg", "exp_avg_sq")      # Adam's arrays, pieces like their parameter's


def _agree(group, err):
    """Every rank raises the same CheckpointError when any rank has one (the lowest rank's)."""
    errs = group.all_gather_object(err) if group.size > 1 else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        r, e = bad[0]
        more = f"; {len(bad)} ranks failed" if len(bad) > 1 else ""
        raise CheckpointError(f"{e} (found on rank {r}{more}; nothing was loaded)" if group.size > 1 else e)


def _strategy(model):
    """``model``, or a plain model (an nn.Module such as GPT) as one process: ``Local(model)``."""
    from pdist.parallel.base import Local, Strategy      # not at the top: verify and inspect need no MPI
    return model if isinstance(model, Strategy) else Local(model)


def _layout(model):
    """The strategy chain and mesh the checkpoint came from (for people; load ignores it)."""
    from pdist.parallel.base import Local
    chain = []
    for s in model.chain():
        d = {"strategy": type(s).__name__}
        if getattr(s, "group", None) is not None:
            d["size"] = s.group.size
        for a in ("stage", "sequence_parallel", "schedule", "num_microbatches", "num_chunks"):
            if hasattr(s, a):
                d[a] = getattr(s, a)
        if isinstance(s, Local):
            d["microbatches"] = s.microbatches
        chain.append(d)
    mesh = getattr(model, "mesh", None)
    sizes = {"dp": mesh.dp_world_size, "tp": mesh.tp_world_size, "pp": mesh.pp_world_size} if mesh else None
    return {"world_size": model.span_group().size, "mesh": sizes, "chain": chain}


def _entries(piece, optimizer):
    """(tensor name, array of the piece's tensor's shape) to save or load for one piece."""
    yield piece.name, piece.tensor.data
    state = optimizer.state.get(id(piece.tensor)) if optimizer is not None else None
    for k in STATES if state else ():
        yield f"optimizer.{k}.{piece.name}", state[k]


def save(model, optimizer, dir, step, extra=None, keep=None):
    """Write a checkpoint of ``model`` (any strategy, or a plain model: one process) and
    ``optimizer`` (AdamW, or None) to ``dir``. Collective. ``extra``: JSON data kept in the
    index (seed, data position). ``keep=K``: when ``dir`` ends in a number (``ckpt/step-000100``),
    keep only the K newest complete siblings of that pattern. Returns the index (rank 0; else None)."""
    model = _strategy(model)
    group = model.span_group()
    me, dir = group.rank, os.path.abspath(os.fspath(dir))
    tmp = None
    if me == 0:
        tmp = f"{dir}.tmp-{secrets.token_hex(4)}"
        os.makedirs(tmp)
    tmp = group.broadcast_object(tmp) if group.size > 1 else tmp
    pieces = model.pieces()
    mine = [p.key() for p in pieces]
    held = group.all_gather_object(mine) if group.size > 1 else [mine]
    owner = {}
    for r, keys in enumerate(held):
        for k in keys:
            owner.setdefault(k, r)                     # the lowest rank holding a replicated piece
    arrays, slices, steps, seen = {}, [], set(), set()
    for p in pieces:
        st = optimizer.state.get(id(p.tensor)) if optimizer is not None else None
        if st:
            steps.add(int(st["step"]))
        if owner[p.key()] != me or p.key() in seen:
            continue
        seen.add(p.key())
        for name, a in _entries(p, optimizer):
            key = piece_key(name, p.offsets)
            arrays[key] = np.ascontiguousarray(to_numpy(p.view(a)))
            box = {"file": rank_file(me), "key": key, "offsets": list(p.offsets), "shape": list(p.shape)}
            slices.append((name, list(p.global_shape), str(arrays[key].dtype), box))
    size, digest = write_safetensors(os.path.join(tmp, rank_file(me)), arrays)
    parts = group.all_gather_object((slices, size, digest, sorted(steps))) if group.size > 1 \
        else [(slices, size, digest, sorted(steps))]
    index = None                       # every rank's file is fsynced once rank 0 has all the parts
    if me == 0:
        index = _index(model, parts, dir, step, extra)
        text = json.dumps(index, indent=1, allow_nan=False) + "\n"
        write_file(os.path.join(tmp, INDEX), text.encode())      # last: it makes the directory a checkpoint
        fsync_dir(tmp)
        _swap_in(tmp, dir)
        if keep:
            prune(dir, keep)
    if group.size > 1:
        group.barrier()                # nobody returns before the checkpoint is in place
    return index


def _index(model, parts, dir, step, extra):
    """The index (rank 0): ``parts`` is every rank's (slices, file bytes, sha256, Adam
    steps); the slices of each tensor are listed under its name."""
    adam = sorted({s for part in parts for s in part[3]})
    if len(adam) > 1:
        raise CheckpointError(f"{dir}: Adam's step differs between tensors ({adam}); "
                              "cannot save one step")
    tensors = {}
    for part in parts:
        for name, gshape, dtype, s in part[0]:
            tensors.setdefault(name, {"shape": gshape, "dtype": dtype, "slices": []})["slices"].append(s)
    cfg = getattr(model.module, "config", None)
    scaler = getattr(model, "scaler", None)          # fp16's GradScaler: S and its growth tracker
    return {"format": FORMAT, "version": VERSION, "step": int(step), "extra": extra,
            "adam_step": adam[0] if adam else None, "layout": _layout(model),
            "scaler": scaler.state_dict() if scaler is not None else None,
            **model_record(cfg),                            # model_type and config
            "files": {rank_file(r): {"bytes": part[1], "sha256": part[2]}
                      for r, part in enumerate(parts)},
            "tensors": tensors}


def _swap_in(tmp, dir):
    """Rename the finished ``tmp`` to ``dir``: one atomic rename for a new directory; for
    an existing one, rename it aside, rename ``tmp`` in, then delete the old one."""
    parent = os.path.dirname(dir)
    if os.path.exists(dir):
        old = f"{dir}.old-{secrets.token_hex(4)}"
        os.rename(dir, old)
        os.rename(tmp, dir)
        fsync_dir(parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, dir)
        fsync_dir(parent)


def prune(dir, keep):
    """Keep the ``keep`` newest complete checkpoints named like ``dir`` (its name with
    the trailing number replaced: ``step-000100`` -> ``step-<digits>``)."""
    m = re.fullmatch(r"(.*?)(\d+)", os.path.basename(dir))
    if not m:
        raise ValueError(f"keep= needs a directory name ending in a number (step-000100), got {dir}")
    parent, pat = os.path.dirname(dir), re.compile(re.escape(m.group(1)) + r"(\d+)")
    found = sorted((int(mm.group(1)), n) for n in os.listdir(parent) if (mm := pat.fullmatch(n))
                   and os.path.exists(os.path.join(parent, n, INDEX)))
    for _, n in found[:-keep]:
        shutil.rmtree(os.path.join(parent, n))


def latest(parent, prefix="step-"):
    """The newest complete checkpoint ``parent/<prefix><number>``, or None."""
    pat = re.compile(re.escape(prefix) + r"(\d+)")
    found = sorted((int(m.group(1)), n) for n in (os.listdir(parent) if os.path.isdir(parent) else [])
                   if (m := pat.fullmatch(n)) and os.path.exists(os.path.join(parent, n, INDEX)))
    return os.path.join(parent, found[-1][1]) if found else None


RUNTIME_CONFIG = ("recompute",)     # how a step runs, not what the weights are: may differ on load


def _check_config(index, model, dir, cast=False):
    """The index's model type and config equal the model's (but for RUNTIME_CONFIG, and ``dtype``
    when ``cast``)."""
    skip = RUNTIME_CONFIG + (("dtype",) if cast else ())
    mine = model_record(getattr(model.module, "config", None))
    if index.get("config") is None or mine["config"] is None:
        return
    theirs = dict(index["config"], model_type=model_type_of(index))     # (an old index: GPT-2)
    diff = [f"{k}: checkpoint {theirs.get(k)!r} vs model {v!r}" for k, v in
            dict(mine["config"], model_type=mine["model_type"]).items()
            if theirs.get(k) != v and k not in skip]
    if diff:
        raise CheckpointError(f"{os.path.join(dir, INDEX)}: the checkpoint's config does not match the "
                              "model (" + "; ".join(diff) + ")")


def load(model, optimizer, dir, checksums=True, cast=False):
    """Load a checkpoint saved under any layout into ``model`` (any strategy, or a plain
    model: one process) and ``optimizer`` (or None: parameters only). Collective. Returns ``(step, extra)``.
    Checks what ``verify`` checks (``validate``: rank r reads the headers and hashes files r, r+n, ...),
    then the config, shapes, dtypes and optimizer entries against the model (``check_model``;
    ``cast=True`` converts float dtypes, which a mixed-precision model's fp32 masters always do),
    reads every piece into new arrays, agrees, and only then copies them in and calls
    ``model.after_load()``. On any problem every rank raises the same CheckpointError."""
    model = _strategy(model)
    group, dir = model.span_group(), os.fspath(dir)
    me, n = group.rank, group.size
    index = err = None
    pieces, new = model.pieces(), []
    try:
        index = read_index(dir)
        validate(dir, index, checksums, share=(me, n))
        _check_config(index, model, dir, cast)
        check_model(dir, index, pieces, STATES if optimizer is not None else (),
                    cast or getattr(model, "precision", "fp32") in ("bf16", "fp16"))
        if getattr(model, "scaler", None) is not None and index.get("scaler") is not None:
            check_scaler(dir, index["scaler"])
    except Exception as e:                  # noqa: BLE001 - every rank must hear of it, never a hang
        err = str(e) if isinstance(e, CheckpointError) else f"{dir}: {type(e).__name__}: {e}"
    _agree(group, err)
    try:
        reader, tensors = Reader(dir, index), index["tensors"]
        for p in pieces:
            vals = {p.name: reader.read_box(p.name, p.offsets, p.shape, p.tensor.data.dtype)}
            for name in (f"optimizer.{k}.{p.name}" for k in (STATES if optimizer is not None else ())):
                if name in tensors:         # check_model: all of them or (saved without) none
                    vals[name] = reader.read_box(name, p.offsets, p.shape, p.tensor.data.dtype)
            new.append(vals)
    except Exception as e:                  # noqa: BLE001
        err = str(e) if isinstance(e, CheckpointError) else f"{dir}: {type(e).__name__}: {e}"
    _agree(group, err)
    for p, vals in zip(pieces, new):                   # every rank read everything: copy in
        p.view(p.tensor.data)[...] = xp.asarray(vals[p.name])
        if optimizer is None or f"optimizer.exp_avg.{p.name}" not in vals:
            continue
        st = optimizer.state.get(id(p.tensor))
        if st is None:
            st = optimizer.state[id(p.tensor)] = {"step": 0, "exp_avg": xp.zeros_like(p.tensor.data),
                                                  "exp_avg_sq": xp.zeros_like(p.tensor.data)}
        for k in STATES:
            p.view(st[k])[...] = xp.asarray(vals[f"optimizer.{k}.{p.name}"])
        st["step"] = int(index["adam_step"])
    scaler = getattr(model, "scaler", None)
    if scaler is not None and index.get("scaler") is not None:    # else it keeps its state (fp32, bf16)
        scaler.load_state_dict(index["scaler"])
    model.after_load()
    return index["step"], index.get("extra")


__all__ = ["save", "load", "latest", "prune", "verify", "consolidate", "from_pretrained", "CheckpointError"]
