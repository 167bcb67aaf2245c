"""Lazy streams (``STRICT_CUPY_LAZY=1``): work queued on a non-default stream runs late.

A GPU runs a stream's kernels whenever it gets to them; the host learns of it only through
events. The eager stand-in runs NCCL at issue, so a program that reads a buffer before its
compute stream waited on the NCCL op's event still sees the right numbers. In lazy mode an
NCCL call on a non-default stream is only queued (one FIFO per process, in issue order,
which every stream's order embeds), and the queue runs up to an event only when

* the current (compute) stream waits on that event (``Stream.wait_event``),
* the host synchronizes (``Event.synchronize``, ``Stream.synchronize``,
  ``Device.synchronize``, ``runtime.deviceSynchronize``),
* a kernel is launched on the stream itself (``with stream:`` runs its queue first).

``Event.done`` (cudaEventQuery) never runs the queue: a host that polls an event it never
ordered anything after waits forever, as it would behind a stuck GPU. A device buffer
whose last reference goes while an op that touches it is queued is *poisoned*: its bytes
are set to 0xFF (NaN in floating point; what a memory pool that hands the block to the
next allocation makes of it) and kept alive for the op, and ``STATS["poisoned"]`` counts
it. ``STATS["queued"]``, ``STATS["ran"]``: ops queued and run so far.

A stalled op (nccl.py, ``STRICT_CUPY_NCCL_STALL``) never runs: a wait on it blocks the
compute stream (events recorded on it after that are never done), and a host read or
synchronize behind it raises ``StuckError`` (on a GPU the host would block forever); the
communicator's ``abort()`` drops it.
"""
import ctypes
import os

STATS = {"queued": 0, "ran": 0, "poisoned": 0}
_queue = []          # [(position, fn, ranges)] not yet run, in issue order
_pos = [0]           # ops queued so far: an event records this
_graveyard = []      # poisoned buffers, kept for the ops that still touch them
_blocked = [0]       # position of a stalled op the compute stream waits on (0: none)


class StuckError(RuntimeError):
    """The host waited, without a deadline, on work that never completes."""


def on():
    return os.environ.get("STRICT_CUPY_LAZY", "") == "1"


def enqueue(stream_ptr, fn, ranges=()):
    """Run ``fn()`` now (eager mode, or the default stream) or queue it; ``ranges`` are the
    (address, nbytes) of the device memory it touches."""
    if not on() or not stream_ptr:
        fn()
        return
    _pos[0] += 1
    STATS["queued"] += 1
    _queue.append((_pos[0], fn, tuple(ranges)))


def position():
    """What an event recorded now on a lazy stream waits for."""
    return _pos[0]


def compute_position():
    """What an event recorded now on the compute stream waits for: nothing, or a stalled op."""
    if _blocked[0] and not any(p == _blocked[0] for p, _, _ in _queue):
        _blocked[0] = 0                       # aborted
    return _blocked[0]


def reached(pos):
    return not _queue or _queue[0][0] > pos


def run_until(pos=None, host=False):
    """Run the queued ops up to position ``pos`` (all of them when None), in issue order.
    A stalled op stops it: the compute stream is blocked (``host``: the host is, StuckError)."""
    while _queue and (pos is None or _queue[0][0] <= pos):
        p, fn, _ = _queue[0]
        if getattr(fn, "stalled", False):
            if host:
                raise StuckError("strict cupy: the host synchronized on a stuck NCCL kernel "
                                 "(STRICT_CUPY_NCCL_STALL); a GPU would block here forever: poll an event "
                                 "under a deadline, and abort the communicator")
            _blocked[0] = p
            return
        _queue.pop(0)
        fn()
        STATS["ran"] += 1
    if not _queue:
        _graveyard.clear()


def host_sync():
    """A device (or stream) synchronize: everything queued must complete."""
    run_until(host=True)


def host_read():
    """A blocking copy to the host on the compute stream: it waits for what the compute stream
    waits for (not for queued work it never waited on), forever if that is a stalled op."""
    if compute_position():
        run_until(_blocked[0], host=True)


def touched(addr, nbytes):
    """True when a queued op touches [addr, addr + nbytes)."""
    return any(a < addr + nbytes and addr < a + n for _, _, rs in _queue for a, n in rs)


def poison(np_array):
    """A device buffer dropped while queued work touches it: fill it with 0xFF bytes and keep it."""
    ctypes.memset(np_array.__array_interface__["data"][0], 0xFF, np_array.nbytes)
    _graveyard.append(np_array)
    STATS["poisoned"] += 1
