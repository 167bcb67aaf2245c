"""The lessons' JSON summary (a contract, docs/design.md "The lessons' JSON summary"):
strict JSON (non-finite numbers become ``null``), written atomically; and the check that
a ``--json`` path (or the grader's ``--csv``) can be written, before any work."""
import json
import math
import os
import tempfile


def json_path_problem(path):
    """Why the summary could not be written to ``path`` (a string), or ``None``."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(d):
        return f"directory {d} does not exist"
    return cannot_create_in(d)


def cannot_create_in(d):
    """Why no file can be created in the existing directory ``d`` (a probe is made and
    removed), or ``None``."""
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".pdist-probe-")
    except OSError as e:
        return f"cannot create a file in directory {d} ({e.strerror or e})"
    os.close(fd)
    os.unlink(probe)
    return None


def write_json_atomic(path, obj):
    """Write ``obj`` as strict JSON to ``path`` atomically (``write_text_atomic``).
    Non-finite floats become ``null`` (see ``_jsonable``)."""
    write_text_atomic(path, json.dumps(_jsonable(obj), indent=1, allow_nan=False) + "\n")


def write_text_atomic(path, text):
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one:
    a temporary file in the same directory (same file system, so the rename is atomic),
    flushed and fsync'ed, then ``os.replace``; the directory is fsync'ed too."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a summary is an ordinary file
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass


def _jsonable(v):
    """``v`` as plain Python (NumPy scalars and arrays, tuples, dicts, recursively),
    with every non-finite float replaced by ``None``; TypeError for other objects."""
    if isinstance(v, float):  # also np.float64, a float subclass
        return float(v) if math.isfinite(v) else None
    if v is None or isinstance(v, (str, bool, int)):
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else v
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    try:
        import numpy as np
        if isinstance(v, (np.generic, np.ndarray)):
            return _jsonable(v.tolist())
    except ImportError:  # pragma: no cover
        pass
    if hasattr(v, "get") and hasattr(v, "shape"):  # a CuPy array or scalar
        return _jsonable(v.get().tolist())
    raise TypeError(f"not JSON serialisable: {type(v)}")
