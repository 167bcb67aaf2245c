"""Host memory policy: glibc malloc's tuning, arrays in mappings of their own, and what
malloc holds free (Linux/glibc; elsewhere each helper says it did nothing).

A training step allocates and frees the same activations and temporaries every step;
``tune_malloc`` (applied when pdist is imported) keeps them on malloc's heap, reused
without page faults. ZeRO's gathered units and full gradients are ``mapped_empty``
arrays, each its own mapping, so freeing one returns its pages to the OS at once and
the RSS drops as ZeRO's formula says (docs/zero.md). ``malloc_trim`` and
``malloc_free_bytes`` measure what the heap keeps (pdist.measure.memory, lesson 03).
"""
import sys
import weakref

import numpy as _np

from pdist.engine.backend import is_gpu, xp
from pdist.engine.env import env_flag

MMAP_THRESHOLD = 32 << 20    # glibc's largest: arrays under 32 MiB come from the heap and are reused
TRIM_THRESHOLD = 256 << 20   # the heap's free top is kept up to 256 MiB (activations, temporaries)
TOP_PAD = 64 << 20           # and grown 64 MiB at a time


def tune_malloc():
    """glibc malloc's policy for pdist: a step's temporaries are reused without page faults;
    what malloc keeps free is reported, and what ZeRO frees goes back to the OS at once.

    A training step allocates and frees the same activations and temporaries every step.
    A fixed ``M_MMAP_THRESHOLD`` of 32 MiB (glibc's largest; fixing it also switches off the
    dynamic threshold) keeps arrays under 32 MiB on the heap, and ``M_TRIM_THRESHOLD`` /
    ``M_TOP_PAD`` keep the heap's free pages mapped, so the next step reuses them instead of
    faulting them in again. Measured with bench/step_time.py --sizes large: 1.5x slower
    with a 1 MiB mmap threshold, every large temporary faulted in each step (docs/zero.md).
    What the heap keeps is measured, not hidden: ``malloc_trim()`` returns it, and lesson 03
    prints the RSS that frees ("malloc held") beside the RSS and the formula.

    ZeRO's own frees do not wait for malloc: its gathered units and full gradients come
    from ``mapped_empty``, each its own mapping, unmapped when it dies, so the RSS drops
    by a unit at each free, as ZeRO-3's formula says.

    Applied on import on glibc Linux; ``PDIST_MALLOC_TUNE=0`` (or off/false/no) keeps
    glibc's defaults, and a value that is not a boolean raises a ValueError. Returns True
    when the settings were applied."""
    if not env_flag("PDIST_MALLOC_TUNE", True) or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        ok &= libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        ok &= libc.mallopt(M_TOP_PAD, TOP_PAD)
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave malloc alone
        return False
    return bool(ok)


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3     # glibc's mallopt parameters


_NUMPY_TRACE_DOMAIN = 389047   # the tracemalloc domain NumPy reports its array data in


def mapped_empty(n, dtype):
    """An (n,) array in an anonymous memory mapping of its own (zero-filled): when its last
    view dies the mapping is unmapped, so the pages go back to the OS at once, whatever
    malloc keeps on its heap. ZeRO's gathered units and full gradients live here: their
    frees are what its formula counts. (malloc's mmap threshold cannot promise this: a
    request that fits the heap's free top is served from the heap.) The mapping is
    reported to tracemalloc in NumPy's domain while tracing, so pdist.measure.memory's traced
    peak counts it like any array. On a GPU it is ``empty`` from CuPy's pool, and
    small arrays come from malloc."""
    dt = _np.dtype(dtype)
    if is_gpu() or n * dt.itemsize < 1 << 16:
        return xp.empty(n, dtype=dt)
    import ctypes
    import mmap
    import tracemalloc
    m = mmap.mmap(-1, n * dt.itemsize)
    a = _np.frombuffer(m, dtype=dt)                                    # (n,), writable, zeros
    if tracemalloc.is_tracing():
        addr, api = a.__array_interface__["data"][0], ctypes.pythonapi
        api.PyTraceMalloc_Track.argtypes = [ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t]
        api.PyTraceMalloc_Untrack.argtypes = [ctypes.c_uint, ctypes.c_size_t]
        api.PyTraceMalloc_Track(_NUMPY_TRACE_DOMAIN, addr, n * dt.itemsize)
        weakref.finalize(m, api.PyTraceMalloc_Untrack, _NUMPY_TRACE_DOMAIN, addr)
    return a


class BufferPool:
    """Free flat buffers kept for reuse: ZeRO-3's gathered units and ZeRO-2/3's full gradients
    are taken from here and given back when freed, so a step re-gathers into pages that are
    already mapped instead of faulting a fresh mapping in (measured: ZeRO-3's step 1.22x DDP's
    with a fresh mapping per gather, docs/zero.md). It holds at most the most buffers that were
    in use at once (prefetch depth + the gradients in flight), and what it holds free is
    *held* memory, as PyTorch's caching allocator reports "reserved" beside "allocated":
    ``held_bytes()`` counts it, and ``malloc_trim()`` empties every pool (the next use maps
    fresh pages), so RSS after a trim is the live memory again.

    A buffer a graph node still views (a view's ``.base`` is the buffer: its reference count
    says so) is only handed back to the unit that freed it (``prefer``): it holds that unit's
    values, and re-gathering the same values into it is safe; never to another unit."""

    def __init__(self):
        self._free = {}                     # (n, dtype) -> [buffers]
        _POOLS.add(self)

    def take(self, n, dtype, prefer=None):
        """A (n,) buffer of ``dtype``: ``prefer`` when it is free here, else a free buffer that
        nothing views, else a fresh ``mapped_empty`` (zeros). Contents are stale: fill it."""
        free = self._free.get((n, _np.dtype(dtype).str), [])
        for i in range(len(free)):
            if free[i] is prefer:
                return free.pop(i)
        for i in range(len(free)):
            if sys.getrefcount(free[i]) <= _UNVIEWED:   # only the list holds it: nothing views it
                return free.pop(i)
        return mapped_empty(n, dtype)

    def give(self, buf):
        """Keep ``buf`` (a 1-D buffer from ``take``) for the next ``take`` of its size."""
        if buf is not None:
            self._free.setdefault((buf.size, buf.dtype.str), []).append(buf)

    def held_bytes(self):
        return sum(int(b.nbytes) for bs in self._free.values() for b in bs)

    def clear(self):
        self._free.clear()


_POOLS = weakref.WeakSet()


def _refs_of_a_listed_array():
    """sys.getrefcount of an array only a list holds (2 on CPython 3.11: the list's and the
    call's), measured here rather than assumed, as interpreters count differently."""
    listed = [_np.empty(1)]
    return sys.getrefcount(listed[0])


_UNVIEWED = _refs_of_a_listed_array()


def held_bytes():
    """Bytes pdist's buffer pools hold free (BufferPool): mapped, resident once used, not live."""
    return sum(p.held_bytes() for p in list(_POOLS))


def malloc_trim():
    """Return the free pages malloc holds to the OS (glibc ``malloc_trim(0)``: the heap's
    top and every free page inside it), after emptying pdist's buffer pools (BufferPool). The RSS
    then counts live memory only; pdist.measure.memory reads RSS after it where a measurement
    needs that. False where there is no glibc (the pools are emptied all the same)."""
    for pool in list(_POOLS):
        pool.clear()
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def malloc_free_bytes():
    """Bytes glibc malloc holds free inside the process (freed, not returned to the OS):
    ``mallinfo2().fordblks``, summed over arenas: free chunks and the heap's reserved top,
    resident or not (with tune_malloc's 64 MiB top pad, more than the RSS gap; the resident
    part is RSS minus RSS after ``malloc_trim``, as lesson 03 prints it). None where there is
    no glibc ``mallinfo2`` (macOS, musl, glibc < 2.33)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        class _MallInfo2(ctypes.Structure):
            _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                       "usmblks", "fsmblks", "uordblks", "fordblks",
                                                       "keepcost")]
        fn = ctypes.CDLL("libc.so.6").mallinfo2
        fn.restype = _MallInfo2
        return int(fn().fordblks)
    except (OSError, AttributeError):
        return None


tune_malloc()

__all__ = ["tune_malloc", "mapped_empty", "BufferPool", "held_bytes", "malloc_trim", "malloc_free_bytes"]
