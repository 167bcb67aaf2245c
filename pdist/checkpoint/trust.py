"""Reading files a stranger may have written: names, file types, sizes and headers, bounded.

The contract (docs/checkpoint.md, "Trust model"): a reader opens only

* names that are plain file names inside the directory it was given
  (``[A-Za-z0-9_][A-Za-z0-9._-]*``: no ``/``, no ``..``, no absolute path, no leading dot);
* regular files: ``os.lstat`` first (a symbolic link, FIFO, socket or device is refused by
  its kind, before any ``open``), then ``open(O_NOFOLLOW | O_NONBLOCK)`` and ``fstat`` of the
  open file (a link or FIFO swapped in between is refused too, without blocking);
* at most a known number of bytes: ``index.json`` <= ``MAX_INDEX_BYTES`` (128 MiB), a
  ``config.json`` <= ``MAX_CONFIG_BYTES`` (16 MiB), a safetensors header <=
  ``MAX_HEADER_BYTES`` (100 MB, safetensors' own limit); a rank file is read only up to the
  size the index gives it, after ``fstat`` says it has exactly that size.

Every failure is a ``CheckpointError`` naming the file and the problem.
"""
import hashlib
import json
import os
import re
import stat

import numpy as np

MAX_INDEX_BYTES = 128 << 20
MAX_CONFIG_BYTES = 16 << 20
MAX_HEADER_BYTES = 100_000_000
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")

# safetensors dtype -> NumPy's name (BF16 has none: NumPy cannot hold it)
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
             "U8": "uint8", "BOOL": "bool"}
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1}


class CheckpointError(ValueError):
    """A checkpoint (or a Hugging Face directory) that cannot be used: the message names the
    file and what is wrong."""


def member(d, name, where):
    """``d/name`` for a ``name`` read from ``where`` (an index, a shard list): a plain file name,
    so the path stays inside ``d`` whatever the name says."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise CheckpointError(f"{where}: file name {name!r} is not a plain file name inside the directory "
                              "(absolute paths, '..', '/' and hidden names are refused)")
    return os.path.join(os.fspath(d), name)


def _kind(mode):
    for test, what in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return what
    return "special file"


def regular_size(path, what, follow=False):
    """The size of ``path``, which must be a regular file (not a link to one: ``os.lstat``;
    ``follow``: a link to a regular file is fine, as in Hugging Face's cache: ``os.stat``)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot stat the {what} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        target = f" to {os.readlink(path)!r}" if stat.S_ISLNK(st.st_mode) else ""
        raise CheckpointError(f"{path}: the {what} is a {_kind(st.st_mode)}{target}, not a regular file "
                              "(a checkpoint holds regular files only)")
    return st.st_size


def open_regular(path, what, follow=False):
    """``(binary file, size)`` of the regular file ``path``, opened without following a link
    (``follow``: to a regular file only) and without blocking on a FIFO; refused by kind
    before and after the open."""
    regular_size(path, what, follow)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) \
        | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open the {what} ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: the {what} is a {_kind(st.st_mode)}, not a regular file")
    return os.fdopen(fd, "rb"), st.st_size


def read_capped(path, cap, what, follow=False):
    """All bytes of the regular file ``path``, refused unread when larger than ``cap``."""
    f, size = open_regular(path, what, follow)
    with f:
        if size > cap:
            raise CheckpointError(f"{path}: the {what} is {size:,} bytes, over the {cap:,}-byte limit "
                                  "(not a file pdist wrote)")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(f"{path}: the {what} grew past the {cap:,}-byte limit while being read")
    return data


def _no_constant(name):
    raise ValueError(f"{name} is not JSON (pdist writes allow_nan=False)")


def read_json(path, cap, what, strict=True, follow=False):
    """The parsed JSON of a regular file of at most ``cap`` bytes (``strict``: NaN/Infinity refused)."""
    data = read_capped(path, cap, what, follow)
    try:
        return json.loads(data, **({"parse_constant": _no_constant} if strict else {}))
    except (ValueError, RecursionError) as e:      # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: unreadable {what} ({type(e).__name__}: {str(e)[:200]})") from None


def sha256_regular(path, size, what="rank file", chunk=1 << 22):
    """sha256 of the regular file ``path``, which must hold exactly ``size`` bytes (read no more)."""
    f, actual = open_regular(path, what)
    h, left = hashlib.sha256(), size
    with f:
        if actual != size:
            raise CheckpointError(f"{path}: truncated or resized: {actual} bytes, the index says {size}")
        while left > 0:
            block = f.read(min(chunk, left))
            if not block:
                raise CheckpointError(f"{path}: shrank while being hashed")
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _is_int(x, low=0):
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def safetensors_header(path, what="safetensors file", follow=False):
    """``{key: (NumPy dtype name, shape tuple)}`` of a safetensors file, from its header only
    (at most ``MAX_HEADER_BYTES`` read). The header is checked as safetensors checks it:
    known dtypes, integer shapes, and data ranges of exactly the tensors' byte sizes that
    tile the data after the header with no gap or overlap."""
    f, size = open_regular(path, what, follow)
    with f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n} in a {size}-byte file; "
                                  f"the limit is {MAX_HEADER_BYTES:,})")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    out, spans = {}, []
    for key, e in header.items():
        ok = isinstance(e, dict) and e.get("dtype") in ST_DTYPES and isinstance(e.get("shape"), list) \
            and all(_is_int(s) for s in e["shape"]) and isinstance(e.get("data_offsets"), list) \
            and len(e["data_offsets"]) == 2 and all(_is_int(o) for o in e["data_offsets"])
        if not ok:
            raise CheckpointError(f"{path}: safetensors entry {key!r} is malformed ({str(e)[:200]})")
        dt = ST_DTYPES[e["dtype"]]
        lo, hi = e["data_offsets"]
        if hi - lo != int(np.prod(e["shape"], dtype=object)) * ITEMSIZE[dt]:
            raise CheckpointError(f"{path}: {key!r}: {hi - lo} data bytes for shape {e['shape']} {dt}")
        out[key] = (dt, tuple(e["shape"]))
        spans.append((lo, hi, key))
    end = 0
    for lo, hi, key in sorted(spans):
        if lo != end:
            raise CheckpointError(f"{path}: {key!r}'s data starts at {lo}, not {end} (overlapping or gapped "
                                  "tensors: not a valid safetensors file)")
        end = hi
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: the header describes {8 + n + end} bytes, the file has {size}")
    return out


__all__ = ["CheckpointError", "MAX_INDEX_BYTES", "MAX_CONFIG_BYTES", "MAX_HEADER_BYTES", "ST_DTYPES",
           "ITEMSIZE", "member", "regular_size", "open_regular", "read_capped", "read_json",
           "sha256_regular", "safetensors_header"]
