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
import os

from pdist.engine.backend import xp
from pdist.checkpoint.format import (INDEX, CheckpointError, Reader, model_record, model_type_of,
                                     read_index, verify)
from pdist.checkpoint.validate import check_model, check_scaler, validate
from pdist.checkpoint.hf import consolidate, from_pretrained
from pdist.checkpoint import runs
from pdist.checkpoint.runs import latest, prune
from pdist.checkpoint.writer import STATES, _strategy, save


def _agree(group, err):
    """Every rank raises the same CheckpointError when any rank has one (the lowest rank's)."""
    errs = group.all_gather_object(err) if group.size > 1 else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        r, e = bad[0]
        more = f"; {len(bad)} ranks failed" if len(bad) > 1 else ""
        raise CheckpointError(f"{e} (found on rank {r}{more}; nothing was loaded)" if group.size > 1 else e)


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
    runs.adopt(model, index)                           # its next saves continue the loaded run (keep=)
    return index["step"], index.get("extra")


__all__ = ["save", "load", "latest", "prune", "verify", "consolidate", "from_pretrained", "CheckpointError"]
