"""The flight recorder: the last calls of this rank, and the step they belong to.

Each rank keeps its last ``PDIST_FLIGHT_RECORDER`` (64) collectives and
point-to-point calls in a ring buffer (one small ``Entry`` per call, made by
``enter``); ``dump()`` writes them as JSON to ``pdist_flight_rank{r}.json`` in
``PDIST_FLIGHT_DIR`` (default: ``flight_dir()``, ``pdist-flight-<uid>`` in the system's
temporary directory, never the checkout) when a rank fails (failures.py), and the failure
report prints the file's absolute path. ``_cur[0]`` is the entry this rank works on now: what its waits
belong to, and what the watchdog's roll-call reports (watchdog.py).

Step stamps. ``set_step(k)`` sets a process-wide training-step number that
every collective's fingerprint carries (check.py), so a rank that skips or
repeats a step is caught at its first collective of the next one.
``set_step(k, batch=h)`` also stamps a 62-bit hash of the step's global batch
(``batch_hash``; 0: none), so ranks handed different batches are caught at the
step's first collective; ``set_batch(0)`` ends it when the step's work is done.
"""
import collections
import json
import operator
import os
import tempfile
import time

from pdist.engine.env import env_number

_step = [0]
_batch = [0]             # hash of this step's global batch (0: none stamped)
_cur = [None]            # the Entry this rank is working on (what its waits belong to)
_flight = collections.deque(maxlen=env_number("PDIST_FLIGHT_RECORDER", 64, "integer (calls kept; 0: off)", 64,
                                              integer=True, zero_ok=True))


class Entry(list):
    """One flight-recorder record: a collective (seq > 0) or a point-to-point call. The list
    [group, ranks, op, seq, step, size, dtype, peer, t] (read as attributes) and its
    ``state``: built as ``Entry((...))`` by list's own constructor, about half a Python
    ``__init__``'s cost (330 against 609 ns with the append, timeit) on the two-rank hot path
    (pair.py), whose record this is."""
    __slots__ = ("state",)
    FIELDS = ("group", "ranks", "op", "seq", "step", "size", "dtype", "peer", "t")
    group, ranks, op, seq, step, size, dtype, peer, t = (property(operator.itemgetter(i)) for i in range(9))

    def as_dict(self):
        d = dict(zip(self.FIELDS, self), state=self.state)
        d["dtype"], d["ranks"] = None if self.dtype is None else str(self.dtype), list(self.ranks)
        return d


def set_step(step, batch=0):
    """The training step every following collective's fingerprint carries, and the hash
    of its global batch (``batch_hash``; 0: not checked)."""
    _step[0] = int(step)
    _batch[0] = int(batch)


def set_batch(batch):
    """The batch hash the following collectives carry (0: none; the end of a step's work)."""
    _batch[0] = int(batch)


def batch_hash(*arrays):
    """A 62-bit hash (never 0) of the arrays' shapes, dtypes and bytes: equal on two ranks
    exactly when they hold the same batch (up to a 2^-62 collision; docs/failures.md gives the
    cost). Host arrays: blake2b over the bytes. Device arrays are never copied: each is folded
    on the device into two 64-bit sums, sum_i (b_i + 1) * m_i with odd-spread multipliers m_i
    over its bytes b_i (wrapping mod 2^64), and the sums of all arrays come back in one read."""
    import hashlib
    import numpy as np
    h = hashlib.blake2b(digest_size=8)
    device = [a for a in arrays if not isinstance(a, np.ndarray) and hasattr(a, "get")]
    for a in arrays:
        h.update(f"{a.shape}{a.dtype.str};".encode())
    if device:
        h.update(_device_sums(device).tobytes())
    for a in arrays:
        if not any(a is d for d in device):
            a = np.ascontiguousarray(np.asarray(a))
            h.update(a.data if a.size else b"")
    return (int.from_bytes(h.digest(), "little") >> 2) or 1


def _device_sums(arrays):
    """(2 * len(arrays),) uint64 on the host: two multiplier-weighted sums of each device array's
    bytes, computed where the array lives; one copy to the host for all of them."""
    from pdist.engine.backend import array_module, to_numpy
    xp = array_module(arrays[0])
    u64, sums = xp.uint64, []
    for a in arrays:
        b = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8).astype(u64) + u64(1)      # (nbytes,)
        i = xp.arange(b.size, dtype=u64)
        for k1, k2 in ((0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9), (0x94D049BB133111EB, 0x2545F4914F6CDD1D)):
            sums.append((b * (i * u64(k1) + u64(k2))).sum(dtype=u64))
    return to_numpy(xp.stack(sums))                 # (guarded: gpu_sync.py)


def get_step():
    return _step[0]


ON_ENTER = []       # called before each call is recorded (failures.py raises a deferred signal there)


def enter(group, op, seq, size=0, dtype=None, peer=None):
    """Record the start of a call and make it this rank's current one."""
    if ON_ENTER:
        for hook in ON_ENTER:
            hook()
    e = Entry((group.name, group.ranks, op, seq, _step[0], size, dtype, peer, time.time()))
    e.state = "started"
    _flight.append(e)
    _cur[0] = e
    return e


def flight():
    return [e.as_dict() for e in _flight]


def flight_dir():
    """Where the dumps go: ``PDIST_FLIGHT_DIR`` if set, else ``<tmp>/pdist-flight-<uid>``
    (created, owner-only), the same on every rank of a node without any communication."""
    d = os.environ.get("PDIST_FLIGHT_DIR")
    if d:
        return os.path.abspath(d)
    uid = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    d = os.path.join(tempfile.gettempdir(), f"pdist-flight-{uid}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def dump(reason, rank, timeout_s):
    """Write this rank's flight recorder as JSON (atomically: a temporary file, then
    ``os.replace``); returns the file's absolute path, or why it was not written."""
    try:
        path = os.path.join(flight_dir(), f"pdist_flight_rank{rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "step": _step[0], "reason": reason, "timeout_s": timeout_s,
                       "current": _cur[0].as_dict() if _cur[0] else None, "entries": flight()}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:          # a read-only directory must not hide the real error
        return f"(not written: {e})"
    return path


def describe(e):
    """'all_reduce #42 on group 'world'' or 'recv from rank 3 on group 'pp''."""
    if e is None:
        return "no collective"
    if e["seq"]:
        return f"{e['op']} #{e['seq']} on group '{e['group']}'"
    return f"{e['op']} {'from' if 'recv' in e['op'] else 'to'} rank {e['peer']} on group '{e['group']}'"
