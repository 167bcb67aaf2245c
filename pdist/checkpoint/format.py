"""The on-disk format of a pdist checkpoint, read and checked without MPI.

A checkpoint is a directory of rank files and one index:

    step-000100/
      rank-00000.safetensors   this rank's pieces: "<tensor>@<off0>,<off1>" -> array
      rank-00001.safetensors   (a replicated piece is written once, by the lowest rank holding it)
      index.json               written last: for every tensor its global shape, dtype and
                               which file holds which box (offsets, shape, key); the layout it
                               came from, the model (``model_type``, its config), the step,
                               ``extra``, each file's size and sha256

Tensors are the single-process model's, under Hugging Face's names (GPT-2's, Llama's), and Adam's
state under ``optimizer.exp_avg.<name>`` / ``optimizer.exp_avg_sq.<name>`` (the same
boxes as the parameter). A reader that wants a box of a tensor intersects it with the
saved boxes (``read_box``), so any layout can read what any layout wrote.

Everything here raises ``CheckpointError`` naming the file and what is wrong.
"""
import hashlib
import json
import os
import re

import numpy as np

from pdist.checkpoint.trust import MAX_INDEX_BYTES, CheckpointError, member, read_json, regular_size
from pdist.checkpoint.validate import INDEX, check_boxes, check_contents, check_sizes, piece_key, validate

FORMAT, VERSION = "pdist-checkpoint", 1


def model_record(cfg):
    """What the index records about the model: its Hugging Face ``model_type`` ("gpt2",
    "llama") and its config (``dataclasses.asdict``), or None for both (no dataclass config)."""
    import dataclasses
    if not dataclasses.is_dataclass(cfg):
        return {"model_type": None, "config": None}
    return {"model_type": getattr(cfg, "model_type", None), "config": dataclasses.asdict(cfg)}


def model_type_of(index):
    """The index's model_type; a checkpoint written before pdist had Llama records none: GPT-2."""
    return index.get("model_type") or ("gpt2" if index.get("config") is not None else None)


def rank_file(rank):
    return f"rank-{rank:05d}.safetensors"


def write_file(path, data):
    """Write bytes, flush and fsync; return (size, sha256 hex)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hashlib.sha256(data).hexdigest()


def box_overlap(offsets, shape, saved_offsets, saved_shape):
    """Where the box (offsets, shape) of a tensor meets a saved box: (slices into the saved
    box, slices into ours), or None when they share no element. Per axis the overlap is
    [max(start), min(end)); empty on any axis means no overlap."""
    lo = [max(a, b) for a, b in zip(offsets, saved_offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, saved_offsets, saved_shape)]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return (tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, saved_offsets)),
            tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets)))


_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path, arrays):
    """Write ``{key: NumPy array}`` as a safetensors file without building it in memory:
    the 8-byte header length, the JSON header (offsets in insertion order, padded to 8
    bytes), then each array's bytes straight from the array. The sha256 runs in a thread
    while the kernel writes the pages back (fsync): hashlib and fsync both release the
    GIL. Returns (size, sha256 hex); readable by ``safetensors.safe_open``."""
    import threading
    header, off = {}, 0
    for k, a in arrays.items():
        header[k] = {"dtype": _ST_DTYPES[str(a.dtype)], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    head = len(text).to_bytes(8, "little") + text
    h = hashlib.sha256(head)
    blocks = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays.values()]   # bytes, no copy
    with open(path, "wb") as f:
        f.write(head)
        for b in blocks:
            f.write(b.data)
        f.flush()
        hasher = threading.Thread(target=lambda: [h.update(b.data) for b in blocks])
        hasher.start()
        os.fsync(f.fileno())
        hasher.join()
    return len(head) + off, h.hexdigest()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# what an unfinished save leaves beside ``<base>``: ``.<base>.pdist-tmp-*`` (being written) and
# ``.<base>.pdist-old-*`` (the previous checkpoint, set aside by an overwrite); see owner.py
LEFTOVER = re.compile(r"\.(?P<base>.+)\.pdist-(?P<kind>tmp|old)-\d+-[0-9a-f]+")


def exchange(a, b):
    """Swap two names atomically (Linux renameat2 RENAME_EXCHANGE); False where the
    platform or file system cannot."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):                 # EINVAL, ENOSYS, EOPNOTSUPP: not here
        return False
    raise OSError(err, os.strerror(err), b)


def aside_copies(dir):
    """The complete-or-not old copies an interrupted overwrite left of ``dir``
    (``.<base>.pdist-old-*``), for a message that says where the previous checkpoint is."""
    parent, base = os.path.split(os.path.abspath(dir))
    names = os.listdir(parent) if os.path.isdir(parent) else []
    return sorted(os.path.join(parent, n) for n in names
                  if (m := LEFTOVER.fullmatch(n)) and m.group("kind") == "old" and m.group("base") == base)


def _missing_hint(d):
    """Where an interrupted overwrite left the previous checkpoint, if anywhere."""
    aside = aside_copies(d)
    return f" (a save was interrupted while swapping directories: the previous one is {aside[0]})" \
        if aside else ""


def read_index(d):
    """The parsed index of checkpoint directory ``d``; CheckpointError when ``d`` is not
    a complete checkpoint of a format version this code reads. Reads at most
    ``MAX_INDEX_BYTES`` of a regular ``index.json``."""
    d = os.fspath(d)
    path = os.path.join(d, INDEX)
    if not os.path.isdir(d):
        raise CheckpointError(f"{d}: no such checkpoint directory{_missing_hint(d)}")
    if not os.path.lexists(path):
        raise CheckpointError(f"{d}: not a pdist checkpoint (no {INDEX}; an interrupted save never "
                              f"writes it, so this directory is incomplete or something else)")
    index = read_json(path, MAX_INDEX_BYTES, "index")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a pdist checkpoint index (format {index.get('format')!r}, "
                              f"want {FORMAT!r})" if isinstance(index, dict) else f"{path}: not an object")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{path}: unknown format version {index.get('version')!r} (this pdist reads "
                              f"version {VERSION})")
    return index


def sha256_file(path, chunk=1 << 22):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def check_files(d, index, names=None, checksums=True):
    """Every rank file named in the index is a regular file of its size; those in ``names``
    (default: all) also have the index's header entries and (``checksums``) sha256."""
    check_sizes(d, index)
    check_contents(d, index, sorted(index["files"]) if names is None else names, checksums)


def check_coverage(index, d=""):
    """The boxes cover every tensor, keys match offsets, each box inside (overlapping
    replicas are compared by ``validate``, which reads the files). Returns the overlaps."""
    return check_boxes(d, index)


def verify(d, checksums=True):
    """A checkpoint is complete and intact: ``validate`` (pdist/checkpoint/validate.py), the
    same checks ``load`` makes: the index's structure, every name inside ``d``, every file
    regular and of its size, boxes that tile their tensors, headers that agree with the
    index, every sha256. Returns the index; raises CheckpointError."""
    return validate(d, read_index(d), checksums=checksums)


class Reader:
    """Reads boxes of saved tensors: each rank file opened once, memory-mapped by
    safetensors; only the intersecting part of each saved slice is read."""

    def __init__(self, d, index):
        self.d, self.index, self.handles = os.fspath(d), index, {}

    def _open(self, name):
        if name not in self.handles:
            from safetensors import safe_open
            path = member(self.d, name, INDEX)
            regular_size(path, "rank file")          # validate() checked it; no link swapped in since
            try:
                self.handles[name] = safe_open(path, framework="numpy")
            except Exception as e:          # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot open as safetensors ({e})") from None
        return self.handles[name]

    def read_box(self, name, offsets, shape, dtype=None):
        """``global[name][offsets : offsets + shape]`` assembled from every saved box
        that overlaps it (box intersection)."""
        t = self.index["tensors"].get(name)
        if t is None:
            raise CheckpointError(f"{INDEX}: no tensor {name!r} in the checkpoint")
        out = np.empty(shape, dtype=dtype or t["dtype"])
        covered = np.zeros(shape, dtype=bool)
        for s in t["slices"]:
            both = box_overlap(offsets, shape, s["offsets"], s["shape"])
            if both is None:
                continue
            src, dst = both
            path = member(self.d, s["file"], INDEX)
            try:
                part = self._open(s["file"]).get_slice(s["key"])[src] if src else \
                    self._open(s["file"]).get_tensor(s["key"])
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read {s['key']!r} ({e})") from None
            if tuple(np.shape(part)) != tuple(d.stop - d.start for d in dst) or str(part.dtype) != t["dtype"]:
                raise CheckpointError(f"{path}: {s['key']!r} is {part.dtype} {list(np.shape(part))} where the "
                                      f"index says {t['dtype']} {s['shape']}")
            out[dst] = part
            covered[dst] = True
        if not covered.all():
            raise CheckpointError(f"{INDEX}: {name} at {list(offsets)}+{list(shape)}: "
                                  f"{int((~covered).sum())} elements are in no rank file")
        return out

    def read_full(self, name, dtype=None):
        t = self.index["tensors"][name]
        return self.read_box(name, (0,) * len(t["shape"]), tuple(t["shape"]), dtype)


def read_tensors(d, prefix=""):
    """{name: full array} of every saved tensor whose name starts with ``prefix``
    (``""``: parameters and optimizer state; consolidate uses the parameters), after
    ``verify``'s checks."""
    index = verify(d)
    r = Reader(d, index)
    return {k: r.read_full(k) for k in index["tensors"] if k.startswith(prefix)}


__all__ = ["CheckpointError", "FORMAT", "VERSION", "INDEX", "model_record", "model_type_of", "rank_file", "piece_key",
           "write_file", "fsync_dir", "read_index", "check_files", "check_coverage", "validate", "verify", "Reader",
           "read_tensors"]
