"""Runs, ``keep=`` and ``latest``: which checkpoints belong to whom (docs/checkpoint.md).

A run is one model instance's sequence of saves. Its id is drawn by rank 0 at the
model's first ``save`` (16 hex digits), broadcast, recorded in every index it writes
(``"run_id"``, with ``"saved_at"``: Unix seconds), and adopted by ``load``: a model that
loads a checkpoint continues that checkpoint's run, so a resume loop with ``keep=K``
keeps pruning the run's older checkpoints, the ones from before the restart included.

``keep=K`` keeps the K most recently saved checkpoints of the run among the siblings
named like the one just written (``step-<digits>``); it never removes that one, never
a checkpoint of another run (or of none: written before pdist recorded runs), never a
directory without a pdist index, and never a file pdist did not write.
``latest`` is the most recently saved complete checkpoint, whatever its step number.
"""
import math
import operator
import os
import re
import warnings
import weakref

from pdist.checkpoint.format import INDEX, CheckpointError, read_index
from pdist.checkpoint.owner import LEFTOVER, Lock, foreign, remove_pdist_dir

_RUNS = weakref.WeakKeyDictionary()       # the model's module -> its run id


def _key(model):
    return getattr(model, "module", model)


def run_id(model):
    """The run id ``model`` (a strategy) saves under, or None before its first save or load."""
    try:
        return _RUNS.get(_key(model))
    except TypeError:                      # not weak-referenceable
        return None


def set_run_id(model, rid):
    try:
        _RUNS[_key(model)] = rid
    except TypeError:
        pass


def adopt(model, index):
    """After ``load``: the model continues the loaded checkpoint's run."""
    if index.get("run_id"):
        set_run_id(model, index["run_id"])


def check_keep(keep):
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) and not hasattr(keep, "__index__"):
        return f"keep={keep!r}: must be a positive int (how many checkpoints of this run to keep) or None"
    if operator.index(keep) < 1:
        return f"keep={keep!r}: must be at least 1 (the checkpoint just written is always kept), or None"
    return None


def check_extra(x, where="extra"):
    """None when ``x`` is JSON data that comes back from ``load`` unchanged: None, bool,
    int, finite float, str, list, dict with str keys; else what is wrong and where."""
    stack = [(x, where, 0)]
    while stack:
        v, at, depth = stack.pop()
        if depth > 64:
            return f"{at}: nested deeper than 64 levels"
        if v is None or isinstance(v, (bool, int, str)):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                return f"{at} = {v}: not finite (JSON has no NaN or infinity); store a finite number or None"
        elif isinstance(v, list):
            stack += [(e, f"{at}[{i}]", depth + 1) for i, e in enumerate(v)]
        elif isinstance(v, dict):
            for k, e in v.items():
                if not isinstance(k, str):
                    return f"{at}: key {k!r} is a {type(k).__name__} (JSON keys are str; it would load as {str(k)!r})"
                stack.append((e, f"{at}[{k!r}]", depth + 1))
        elif isinstance(v, tuple):
            return f"{at} = {v!r}: a tuple (it would load as a list); pass a list"
        else:
            return (f"{at} = {v!r}: a {type(v).__name__}, not JSON data; convert it (float(x), int(x), "
                    f"x.tolist())")
    return None


def check_args(dir, step, extra, keep, overwrite):
    """What is wrong with ``save``'s arguments (before anything is written), or None."""
    if isinstance(step, bool) or not hasattr(step, "__index__") or operator.index(step) < 0:
        return f"step={step!r}: must be a non-negative int"
    if not isinstance(overwrite, bool):
        return f"overwrite={overwrite!r}: must be True or False"
    bad = check_keep(keep) or check_extra(extra, "extra")
    if bad:
        return bad
    if keep is not None and not re.fullmatch(r".*?\d+", os.path.basename(dir)):
        return (f"keep={keep} needs a directory name ending in a number, such as step-000100, to find the "
                f"run's other checkpoints; got {dir}")
    return None


def describe_entries(dir, limit=3):
    names = sorted(os.listdir(dir))
    shown = [n + ("/" if os.path.isdir(os.path.join(dir, n)) else "") for n in names[:limit]]
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} ({', '.join(shown)}" + \
        (", ...)" if len(names) > limit else ")")


def check_target(dir, step, overwrite):
    """None when ``save`` may write ``dir`` (absent, an empty directory, or with
    ``overwrite`` a pdist checkpoint holding only pdist's files), else why not."""
    if not os.path.lexists(dir):
        return None
    if os.path.islink(dir):
        return (f"{dir} is a symbolic link (to {os.readlink(dir)}); save does not write through links: "
                "pass the real path")
    new = os.path.join(dir, f"step-{int(step):06d}")
    if not os.path.isdir(dir):
        return (f"{dir} is a {'regular file' if os.path.isfile(dir) else 'special file'}, not a pdist "
                f"checkpoint; save never replaces what pdist did not write: pass another path "
                f"(such as {new}), or move the file away")
    if not os.listdir(dir):
        return None
    if not os.path.exists(os.path.join(dir, INDEX)):
        return (f"{dir} is a directory holding {describe_entries(dir)} and no {INDEX}: it is not a pdist "
                f"checkpoint, and save never replaces what pdist did not write; pass the checkpoint's own "
                f"directory, such as {new}")
    try:
        index = read_index(dir)
    except CheckpointError as e:
        return f"{dir} holds an {INDEX} that is not a readable pdist index ({e}); save will not replace it"
    other = foreign(dir)
    if other:
        return (f"{dir} is a pdist checkpoint (step {index.get('step')}) that also holds files pdist did not "
                f"write ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}); move them out first")
    if not overwrite:
        return (f"{dir} is already a pdist checkpoint (step {index.get('step')}); pass overwrite=True to "
                f"replace it (the old one stays whole until the new one is complete), or save to a new "
                f"directory")
    return None


def _sort_key(path, index):
    saved = index.get("saved_at")
    if not isinstance(saved, (int, float)):
        saved = os.stat(os.path.join(path, INDEX)).st_mtime     # written before pdist recorded it
    return (saved, index.get("step") if isinstance(index.get("step"), int) else -1, path)


def _checkpoints(parent, pattern, asides=False):
    """[(sort key, path, index)] of the complete checkpoints ``parent/<pattern>`` (and, with
    ``asides``, an interrupted overwrite's old copy whose name is missing)."""
    out = []
    names = os.listdir(parent) if os.path.isdir(parent) else []
    for n in names:
        m = LEFTOVER.fullmatch(n)
        if pattern.fullmatch(n) or asides and m and m.group("kind") == "old" and pattern.fullmatch(
                m.group("base")) and not os.path.lexists(os.path.join(parent, m.group("base"))):
            path = os.path.join(parent, n)
            if os.path.islink(path) or not os.path.isdir(path):
                continue
            try:
                index = read_index(path)
            except CheckpointError:
                continue
            out.append((_sort_key(path, index), path, index))
    return sorted(out, key=lambda t: t[0])


def latest(parent, prefix="step-"):
    """The most recently saved complete checkpoint ``parent/<prefix><number>`` (by the
    index's ``saved_at``), or None. A save killed between the two renames of an overwrite
    leaves the previous checkpoint as ``.<name>.pdist-old-*``: that one is returned then."""
    found = _checkpoints(os.fspath(parent), re.compile(re.escape(prefix) + r"\d+"), asides=True)
    return found[-1][1] if found else None


def prune(dir, keep, run=None):
    """Keep the ``keep`` most recently saved checkpoints of run ``run`` (default: the run
    of ``dir``'s index) named like ``dir`` (``step-000100`` -> ``step-<digits>``), ``dir``
    always among them. Returns the paths removed; a checkpoint that holds files pdist did
    not write, or whose writer holds its lock, is left (with a warning)."""
    bad = check_keep(keep)
    if bad:
        raise CheckpointError(bad)
    dir = os.path.abspath(os.fspath(dir))
    m = re.fullmatch(r"(.*?)(\d+)", os.path.basename(dir))
    if not m:
        raise CheckpointError(f"keep= needs a directory name ending in a number (step-000100), got {dir}")
    run = run or read_index(dir).get("run_id")
    if not run:
        raise CheckpointError(f"{dir}: its index records no run id (written before pdist recorded runs); "
                              "prune removes only checkpoints of one run")
    pattern = re.compile(re.escape(m.group(1)) + r"\d+")
    ours = [p for _, p, index in _checkpoints(os.path.dirname(dir), pattern)
            if index.get("run_id") == run and p != dir]
    removed = []
    for path in ours[:max(len(ours) - (operator.index(keep) - 1), 0)]:
        lock = Lock(path).try_acquire()
        if lock is None:
            warnings.warn(f"keep=: left {path}: another save is writing it", stacklevel=2)
            continue
        try:
            other = foreign(path)
            if other:
                warnings.warn(f"keep=: left {path}: it holds {', '.join(other[:3])}, which pdist did not "
                              f"write", stacklevel=2)
            else:
                remove_pdist_dir(path)
                removed.append(path)
        finally:
            lock.release()
    return removed


__all__ = ["adopt", "check_args", "check_target", "check_extra", "check_keep", "latest", "prune", "run_id"]
