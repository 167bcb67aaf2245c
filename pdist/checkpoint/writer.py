"""``save``: each rank's pieces as boxes of the single-process tensors (docs/checkpoint.md).

Rank 0 checks the arguments and the path and takes the path's lock (pdist/checkpoint/owner.py);
every rank writes its file into the temporary sibling; once every file is fsynced, rank 0
writes the index (last) and swaps the directory into place; every rank hears the outcome.
"""
import json
import os
import secrets
import time
import warnings

import numpy as np

from pdist.engine.backend import to_numpy
from pdist.checkpoint import runs
from pdist.checkpoint.format import (FORMAT, INDEX, VERSION, CheckpointError, fsync_dir, model_record,
                                     piece_key, rank_file, write_file, write_safetensors)
from pdist.checkpoint.owner import Lock, clean_leftovers, remove_pdist_dir, swap_in, tmp_name

STATES = ("exp_avg", "exp_avg_sq")      # Adam's arrays, pieces like their parameter's


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
    for axis in ("cp", "ep", "dp_replicate") if mesh else ():    # recorded where used (> 1)
        if getattr(mesh, f"{axis}_world_size", 1) > 1:
            sizes[axis] = getattr(mesh, f"{axis}_world_size")
    if sizes and "dp_replicate" in sizes:                        # HSDP: dp = dp_replicate x dp_shard
        sizes["dp_shard"] = mesh.dp_shard_world_size
    return {"world_size": model.span_group().size, "mesh": sizes, "chain": chain}


def _entries(piece, optimizer):
    """(tensor name, array of the piece's tensor's shape) to save or load for one piece."""
    yield piece.name, piece.tensor.data
    state = optimizer.state.get(id(piece.tensor)) if optimizer is not None else None
    for k in STATES if state else ():
        yield f"optimizer.{k}.{piece.name}", state[k]


def save(model, optimizer, dir, step, extra=None, keep=None, overwrite=False):
    """Write a checkpoint of ``model`` (any strategy, or a plain model: one process) and
    ``optimizer`` (AdamW, or None) to ``dir``. Collective. Returns the index (rank 0; else None).

    ``extra``: JSON data kept in the index (seed, data position), checked first.
    ``dir`` must not exist, be an empty directory, or (``overwrite=True``) be a pdist
    checkpoint, which stays whole until the new one is complete; anything else is refused
    before any rank writes. ``keep=K`` (a positive int): keep only the K most recently
    saved checkpoints of this run named like ``dir`` (``ckpt/step-<digits>``), ``dir``
    always among them (pdist/checkpoint/runs.py). One writer per path (a lock file);
    every refusal or failure is the same CheckpointError on every rank, and leaves
    nothing behind but what the next save in that parent cleans (pdist/checkpoint/owner.py)."""
    model = _strategy(model)
    group = model.span_group()
    me, dir = group.rank, os.path.abspath(os.fspath(dir))
    _agree_save(group, runs.check_args(dir, step, extra, keep, overwrite))
    tmp, rid, lock = _begin(model, group, dir, step, overwrite)
    index = err = None
    try:
        part = _write_part(model, optimizer, group, tmp)
        parts = group.all_gather_object(part) if group.size > 1 else [part]
        err = next((p[0] for p in parts if p[0] is not None), None)
        if me == 0 and err is None:
            try:
                index = _commit(model, parts, tmp, dir, step, extra, rid)
            except Exception as e:                 # an index or rename that fails: every rank hears it
                err = f"{dir}: saving failed on rank 0 ({type(e).__name__}: {e})"
    finally:
        if me == 0:
            _finish(tmp, lock, index is None)
    err = group.broadcast_object(err) if group.size > 1 else err      # nobody returns before it is in place
    if err:
        raise CheckpointError(f"{err}; nothing was left behind, and whatever was at {dir} is "
                              "untouched")
    if me == 0 and keep:
        try:
            runs.prune(dir, keep, rid)
        except (CheckpointError, OSError) as e:
            warnings.warn(f"{dir} was saved, but keep={keep} could not prune: {e}", stacklevel=2)
    return index


def _agree_save(group, err):
    """Every rank raises the same CheckpointError when any rank has one (the lowest rank's)."""
    errs = group.all_gather_object(err) if group.size > 1 else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        r, e = bad[0]
        raise CheckpointError(f"{e} (found on rank {r}; nothing was written)" if group.size > 1 else
                              f"{e} (nothing was written)")


def _begin(model, group, dir, step, overwrite):
    """Rank 0 takes ``dir``'s lock, cleans what dead saves left in the parent, checks
    ``dir`` and makes the temporary directory; every rank gets (tmp, run id) or the error."""
    claim, lock = (None, None, None), None
    if group.rank == 0:
        claim, lock = _claim(model, dir, step, overwrite)
    tmp, rid, err = group.broadcast_object(claim) if group.size > 1 else claim
    if err:
        raise CheckpointError(f"{err} (nothing was written)")
    runs.set_run_id(model, rid)
    return tmp, rid, lock


def _claim(model, dir, step, overwrite):
    parent = os.path.dirname(dir)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        return (None, None, f"{dir}: cannot create its parent directory ({e})"), None
    lock = Lock(dir)
    try:
        lock.acquire()
        clean_leftovers(parent, mine=os.path.basename(dir))
        why = runs.check_target(dir, step, overwrite)
        if why is None:
            tmp = tmp_name(dir)
            os.mkdir(tmp)
            return (tmp, runs.run_id(model) or secrets.token_hex(8), None), lock
    except CheckpointError as e:
        why = str(e)
    except Exception as e:                             # OSError, or a surprise: every rank hears it
        why = f"{dir}: cannot prepare the save ({type(e).__name__}: {e})"
    lock.release()
    return (None, None, why), None


def _write_part(model, optimizer, group, tmp):
    """This rank's pieces into ``tmp/rank-<me>.safetensors``: (error or None, slices,
    file bytes, sha256, Adam steps). A replicated piece is written by its lowest rank."""
    me, pieces = group.rank, model.pieces()
    mine = [p.key() for p in pieces]
    held = group.all_gather_object(mine) if group.size > 1 else [mine]
    owner = {}
    for r, keys in enumerate(held):
        for k in keys:
            owner.setdefault(k, r)                     # the lowest rank holding a replicated piece
    path = os.path.join(tmp, rank_file(me))
    try:
        slices, arrays, steps = _gather_pieces(pieces, optimizer, owner, me)
        size, digest = write_safetensors(path, arrays)
    except Exception as e:                             # a full disk, a quota: every rank hears of it
        return (f"{path}: writing failed on rank {me} ({type(e).__name__}: {e})", None, None, None, None)
    return (None, slices, size, digest, sorted(steps))


def _gather_pieces(pieces, optimizer, owner, me):
    """(slices for the index, {key: array} for the file, Adam steps) of the pieces this rank writes."""
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
    return slices, arrays, steps


def _commit(model, parts, tmp, dir, step, extra, rid):
    """Rank 0, once every rank's file is fsynced: the index (last: it makes the directory
    a checkpoint), then ``tmp`` into place (owner.swap_in)."""
    index = _index(model, [p[1:] for p in parts], dir, step, extra, rid)
    text = json.dumps(index, indent=1, allow_nan=False) + "\n"
    write_file(os.path.join(tmp, INDEX), text.encode())
    fsync_dir(tmp)
    swap_in(tmp, dir)
    return index


def _finish(tmp, lock, failed):
    """Rank 0: after a failure remove the temporary directory (pdist's files only); release the lock."""
    try:
        if failed and tmp and os.path.isdir(tmp):
            left = remove_pdist_dir(tmp)
            if left:
                warnings.warn(f"{tmp}: left in place: it holds {', '.join(left)}, which pdist did not write",
                              stacklevel=3)
    finally:
        lock.release()


def _index(model, parts, dir, step, extra, rid):
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
            "run_id": rid, "saved_at": time.time(),
            "adam_step": adam[0] if adam else None, "layout": _layout(model),
            "scaler": scaler.state_dict() if scaler is not None else None,
            **model_record(cfg),                            # model_type and config
            "files": {rank_file(r): {"bytes": part[1], "sha256": part[2]}
                      for r, part in enumerate(parts)},
            "tensors": tensors}


__all__ = ["save"]
