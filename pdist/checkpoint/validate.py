"""What a checkpoint must be before anything is read from it: one function, ``validate``,
that ``verify`` runs and that ``load`` runs on every rank (docs/checkpoint.md, "Trust model").

    index = read_index(d)                        # format.py: a regular index.json <= 128 MiB
    validate(d, index, checksums=True, share=(0, 1))

``validate`` checks, raising one CheckpointError naming the file and the problem:

1. the index's structure: every field's type (``files``: name -> {bytes, sha256};
   ``tensors``: name -> {shape, dtype, slices}), every file name a plain name inside ``d``,
   every slice's file listed in ``files``; optimizer state for every parameter or for none;
2. every listed file: a regular file (no link, FIFO or device) of exactly the size the
   index gives it (``os.lstat``, nothing read), and the tensors' bytes fit in the files;
3. the boxes: each slice's key is ``<tensor>@<its offsets>`` (a box moved to other offsets,
   as in a swap, no longer matches its key), each box lies inside its tensor, and the
   boxes cover every element; where two overlap (a replica written twice: pipeline
   parallelism's tied embedding), step 4 requires the same bits in both;
4. for the files in ``share`` (default: all; ``load`` gives rank r the files r, r+n, ...):
   the safetensors header (<= 100 MB) lists each slice's key with the index's dtype and
   the slice's shape, (``checksums``) the file's sha256 is the index's, and overlapping
   boxes whose first lies in the file hold the same bits as the other.
"""
import bisect
import os

import numpy as np

from pdist.checkpoint.trust import (ITEMSIZE, CheckpointError, member, regular_size, safetensors_header,
                                    sha256_regular)

INDEX = "index.json"
DTYPES = tuple(ITEMSIZE)
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")      # Adam's arrays: optimizer.<state>.<parameter>


def piece_key(tensor, offsets):
    return f"{tensor}@{','.join(map(str, offsets))}"


def _int(x, low=0):
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _ints(xs, n=None):
    return isinstance(xs, list) and (n is None or len(xs) == n) and all(_int(x) for x in xs)


def _hex64(s):
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def check_index(d, index):
    """The index's structure (step 1): types, names inside ``d``, slices' files listed."""
    where = os.path.join(os.fspath(d), INDEX)

    def bad(what):
        raise CheckpointError(f"{where}: {what}")
    if not _int(index.get("step")):
        bad(f"step {index.get('step')!r} is not a non-negative integer")
    if index.get("adam_step") is not None and not _int(index["adam_step"]):
        bad(f"adam_step {index['adam_step']!r} is not a non-negative integer")
    for k in ("config", "scaler"):
        if index.get(k) is not None and not isinstance(index[k], dict):
            bad(f"{k} is a {type(index[k]).__name__}, not an object")
    files, tensors = index.get("files"), index.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        bad("'files' and 'tensors' must be objects")
    for name, f in files.items():
        member(d, name, f"{where}: files")
        if not (isinstance(f, dict) and _int(f.get("bytes")) and _hex64(f.get("sha256"))):
            bad(f"files[{name!r}] must be {{'bytes': int >= 0, 'sha256': 64 hex digits}}, got {str(f)[:120]}")
    for name, t in tensors.items():
        if not (isinstance(t, dict) and _ints(t.get("shape")) and t.get("dtype") in DTYPES
                and isinstance(t.get("slices"), list)):
            bad(f"tensors[{name!r}] must be {{'shape': [int >= 0], 'dtype': one of {list(DTYPES)}, "
                f"'slices': [...]}}, got {str(t)[:160]}")
        for s in t["slices"]:
            nd = len(t["shape"])
            if not (isinstance(s, dict) and isinstance(s.get("key"), str) and isinstance(s.get("file"), str)
                    and _ints(s.get("offsets"), nd)
                    and _ints(s.get("shape"), nd)):
                bad(f"{name}: slice {str(s)[:160]} must be {{'file': str, 'key': str, 'offsets': {nd} ints, "
                    f"'shape': {nd} ints}}")
            if s.get("file") not in files:
                member(d, s.get("file"), f"{where}: {name}")        # a name outside d says so first
                bad(f"{name}: slice {s['key']!r} names file {s.get('file')!r}, which 'files' does not list "
                    "(so nothing checks its size or sha256)")


def check_optimizer(d, index):
    """Optimizer state is all or nothing: when the index holds any ``optimizer.<state>.<name>``,
    every parameter has each of ``OPTIMIZER_STATES`` with its shape, and each belongs to one."""
    tensors, where = index["tensors"], os.path.join(os.fspath(d), INDEX)
    opt = [k for k in tensors if k.startswith("optimizer.")]
    if not opt:
        return
    params = [k for k in tensors if not k.startswith("optimizer.")]
    missing = [f"optimizer.{s}.{p}" for p in params for s in OPTIMIZER_STATES if f"optimizer.{s}.{p}" not in tensors]
    if missing:
        raise CheckpointError(f"{where}: the checkpoint holds optimizer state but no {missing[0]}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: incomplete or edited "
                              "(load with optimizer=None to restore the parameters only)")
    for k in opt:
        state, _, p = k[len("optimizer."):].partition(".")
        if state not in OPTIMIZER_STATES or p not in tensors or tensors[p]["shape"] != tensors[k]["shape"]:
            raise CheckpointError(f"{where}: {k} is not the {'/'.join(OPTIMIZER_STATES)} of a saved parameter of "
                                  "its shape")


def check_sizes(d, index):
    """Every listed file is a regular file of the index's size (step 2, ``os.lstat`` only),
    and the tensors' bytes fit in them (which bounds the memory step 3 needs)."""
    total = 0
    for name in sorted(index["files"]):
        path, want = member(d, name, INDEX), index["files"][name]["bytes"]
        size = regular_size(path, "rank file")
        if size != want:
            raise CheckpointError(f"{path}: truncated or resized: {size} bytes, the index says {want}")
        total += size
    need = sum(int(np.prod(t["shape"], dtype=object)) * ITEMSIZE[t["dtype"]] for t in index["tensors"].values())
    if need > total:
        raise CheckpointError(f"{os.path.join(d, INDEX)}: the tensors need {need:,} bytes, the rank files hold "
                              f"only {total:,}")


def _edges(shape, boxes, axis):
    return sorted({0, shape[axis]} | {o[axis] for o, _ in boxes} | {o[axis] + n[axis] for o, n in boxes})


def _grid(shape, slices):
    """The grid the boxes' edges cut the tensor into (at most one cell per element, usually a
    few per box), each cell's count of covering boxes, and each box's range of cells."""
    boxes = [s for s in slices if all(s["shape"])]
    edges = [sorted({0, g} | {s["offsets"][a] for s in boxes} | {s["offsets"][a] + s["shape"][a] for s in boxes})
             for a, g in enumerate(shape)]
    count = np.zeros([len(e) - 1 for e in edges], dtype=np.int32)
    cells = []
    for s in boxes:
        cells.append(tuple(slice(bisect.bisect_left(e, o), bisect.bisect_left(e, o + n))
                           for e, o, n in zip(edges, s["offsets"], s["shape"])))
        count[cells[-1]] += 1
    return boxes, edges, count, cells


def _overlaps(boxes, count, cells):
    """Pairs of boxes that share elements (only boxes on a cell covered twice are compared)."""
    hot = [(s, c) for s, c in zip(boxes, cells) if (count[c] > 1).any()]
    out = []
    for i, (s, _) in enumerate(hot):
        for t, _ in hot[i + 1:]:
            lo = [max(a, b) for a, b in zip(s["offsets"], t["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(s["offsets"], s["shape"], t["offsets"], t["shape"])]
            if all(h > low for low, h in zip(lo, hi)):
                out.append((s, t, lo, hi))
    return out


def check_boxes(d, index):
    """Step 3: each slice's key matches its offsets, each box lies inside its tensor, and the
    boxes cover every element. Returns the overlapping pairs ``(tensor, slice, slice, lo, hi)``:
    a replica saved twice (pipeline parallelism's tied embedding) overlaps, and ``validate``
    requires the two to hold the same bits there."""
    where, overlaps = os.path.join(os.fspath(d), INDEX), []
    for name, t in index["tensors"].items():
        shape, slices = t["shape"], t["slices"]
        for s in slices:
            if s["key"] != piece_key(name, s["offsets"]):
                raise CheckpointError(f"{where}: {name}: slice key {s['key']!r} in {s['file']} does not match "
                                      f"its offsets {s['offsets']} (swapped or edited boxes)")
            if any(o + n > g for o, n, g in zip(s["offsets"], s["shape"], shape)):
                raise CheckpointError(f"{where}: {name}: box {s['offsets']}+{s['shape']} in {s['file']} lies "
                                      f"outside the tensor's shape {shape}")
        boxes, edges, count, cells = _grid(shape, slices)
        if (count == 0).any():
            sizes = np.ones(count.shape, dtype=object)
            for a, e in enumerate(edges):
                sizes = sizes * np.diff(e).reshape([-1 if b == a else 1 for b in range(len(edges))])
            gap = int(np.sum(sizes[count == 0]))
            raise CheckpointError(f"{where}: {name}: {gap} of {int(np.prod(shape, dtype=object))} elements "
                                  "are in no rank file (incomplete checkpoint)")
        if (count > 1).any():
            overlaps += [(name, *o) for o in _overlaps(boxes, count, cells)]
    return overlaps


def check_overlaps(d, overlaps, names):
    """Where two boxes overlap, both files hold the same bits (compared for the pairs whose
    first box is in a file of ``names``): else the boxes were swapped or edited."""
    from safetensors import safe_open
    for name, s, t, lo, hi in overlaps:
        if s["file"] not in names:
            continue
        parts = []
        for b in (s, t):
            with safe_open(member(d, b["file"], INDEX), framework="numpy") as f:
                parts.append(np.ascontiguousarray(f.get_slice(b["key"])[
                    tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, b["offsets"]))]))
        if parts[0].tobytes() != parts[1].tobytes():
            raise CheckpointError(f"{os.path.join(os.fspath(d), INDEX)}: {name}: boxes {s['offsets']}+{s['shape']} "
                                  f"in {s['file']} and {t['offsets']}+{t['shape']} in {t['file']} overlap on "
                                  f"[{lo}, {hi}) and differ there (overlapping boxes must be copies of one "
                                  "replica; these were swapped or edited)")


def check_contents(d, index, names, checksums=True):
    """Step 4 for the files ``names``: the header agrees with the index, and the sha256."""
    want = {}
    for name, t in index["tensors"].items():
        for s in t["slices"]:
            want.setdefault(s["file"], []).append((s["key"], t["dtype"], tuple(s["shape"])))
    for name in names:
        path, f = member(d, name, INDEX), index["files"][name]
        header = safetensors_header(path, "rank file")
        for key, dtype, shape in want.get(name, ()):
            if key not in header:
                raise CheckpointError(f"{path}: no tensor {key!r}, which the index places in this file")
            if header[key] != (dtype, shape):
                raise CheckpointError(f"{path}: {key!r} is {header[key][0]} {list(header[key][1])} in the file, "
                                      f"{dtype} {list(shape)} in the index")
        if checksums and sha256_regular(path, f["bytes"]) != f["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch (the file's bytes changed since it was saved)")


def validate(d, index, checksums=True, share=(0, 1)):
    """Steps 1-4 (the module's docstring) on ``d``'s parsed ``index``; ``share=(r, n)``: step 4
    for the files r, r+n, ... in sorted order only (``load``'s ranks split the reading and
    hashing; default: all). Returns ``index``."""
    d = os.fspath(d)
    check_index(d, index)
    check_optimizer(d, index)
    check_sizes(d, index)
    overlaps = check_boxes(d, index)
    names = sorted(index["files"])[share[0]::share[1]]
    check_contents(d, index, names, checksums)
    check_overlaps(d, overlaps, set(names))
    return index


def _float(dt):
    return dt.startswith(("float", "bfloat"))


def check_model(d, index, pieces, optimizer_states=(), cast=False):
    """What ``load`` needs beyond ``validate``: every piece's tensor is in the index with the
    model's global shape and dtype (``cast``: any float dtype converts to the model's, as a
    mixed-precision model's fp32 masters take a float64 checkpoint); with an optimizer
    (``optimizer_states``: Adam's "exp_avg", "exp_avg_sq") and a checkpoint holding optimizer
    state, every piece's state entries too. All before anything is loaded."""
    where, tensors = os.path.join(os.fspath(d), INDEX), index["tensors"]
    if not any(k.startswith("optimizer.") for k in tensors):
        optimizer_states = ()                  # saved without an optimizer: its state is left alone
    for p in pieces:
        names = [p.name] + [f"optimizer.{k}.{p.name}" for k in optimizer_states]
        missing = [n for n in names if n not in tensors]
        if missing and missing[0] == p.name:
            raise CheckpointError(f"{where}: {p.name}: the model has it (shape {list(p.global_shape)}), "
                                  "the checkpoint does not")
        if missing:
            raise CheckpointError(f"{where}: no {' or '.join(missing)}: the checkpoint holds optimizer state, "
                                  f"but not for {p.name} (load with optimizer=None to restore the parameters only)")
        have = str(p.tensor.data.dtype)
        for n in names:
            t = tensors[n]
            if tuple(t["shape"]) != tuple(p.global_shape):
                raise CheckpointError(f"{where}: {n}: the model's shape is {list(p.global_shape)}, the "
                                      f"checkpoint's {t['shape']}")
            if t["dtype"] != have and not (cast and _float(t["dtype"]) and _float(have)):
                raise CheckpointError(f"{where}: {n}: the checkpoint holds {t['dtype']}, the model {have} "
                                      "(pass cast=True to convert, or build the model in the checkpoint's dtype)")


def check_scaler(d, sd):
    """A GradScaler state from the index (fp16): positive finite scale and factors, integer counters."""
    import math
    num = (lambda x, lo: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > lo)
    ok = isinstance(sd, dict) and num(sd.get("scale"), 0) and num(sd.get("growth_factor"), 0) \
        and num(sd.get("backoff_factor"), 0) and _int(sd.get("growth_interval"), 1) and _int(sd.get("_growth_tracker"))
    if not ok:
        raise CheckpointError(f"{os.path.join(os.fspath(d), INDEX)}: scaler {str(sd)[:200]} is not a GradScaler "
                              "state (positive finite scale, growth_factor, backoff_factor; integer "
                              "growth_interval >= 1, _growth_tracker >= 0)")


__all__ = ["INDEX", "OPTIMIZER_STATES", "piece_key", "check_index", "check_optimizer", "check_sizes", "check_boxes",
           "check_overlaps", "check_contents", "validate", "check_model", "check_scaler"]
