"""Per-rank memory accounting: the live bytes of parameters, gradients and
optimizer states, and a real peak measurement.

Model states (what the ZeRO paper counts: Rajbhandari et al., 2020, sec. 3.1):

    params_bytes = Σ bytes of the distinct buffers holding parameters
    grads_bytes  = Σ bytes of the distinct buffers holding gradients
    optim_bytes  = Σ bytes of the optimizer's state arrays (AdamW: m and v)

"Distinct buffers": an array that is a view (a parameter inside a flat
FSDP/ZeRO buffer, a shard that is a slice of it) is counted through the buffer
it lives in, once, whole. So a flat buffer of Ψ_pad elements counts Ψ_pad
elements, padding included, however many views point into it.

Peak: ``PeakMemory`` measures the largest number of bytes allocated at once
during a block of code, by the array library itself:

* NumPy reports every array allocation to ``tracemalloc``: the peak is
  ``tracemalloc.get_traced_memory()[1]`` after ``reset_peak()``. It counts what
  was allocated *while tracing* and is still alive (plus Python objects, which
  are small next to arrays), so call ``start_tracing()`` before building the
  model to include its states.
* CuPy: a ``cupy.cuda.MemoryHook`` sees every array taken from and given back to the
  pool; the peak is the live bytes' maximum (pdist/measure/device_memory.py, which also
  reports the pool's held bytes and the driver's mem_info beside it).

    memory.start_tracing(restart=True)
    model = ...; opt = ...
    with memory.PeakMemory() as pk:
        train_step()
    row = memory.memory_row(rank, model, opt, pk.peak_bytes)   # the JSON's memory_per_rank entry

What the process holds (the operating system's count, which includes the
interpreter, the libraries and whatever malloc keeps free): ``rss_bytes()`` is
``VmRSS`` of /proc/self/status, ``rss_peak_bytes()`` its high-water mark ``VmHWM``,
which ``reset_rss_peak()`` sets back to the current RSS (writing "5" to
/proc/self/clear_refs, Linux). ``RSSPeak`` measures a block's peak that way:

    with memory.RSSPeak() as rp:
        train_step()
    rp.peak_bytes, rp.exact     # exact False: no reset here, the peak is since the process began

Where /proc is missing (macOS) the peak is ``resource.getrusage``'s ``ru_maxrss``
(since the process began, never reset) and the current RSS is None.
``pdist.engine.host_memory.malloc_free_bytes()`` is what malloc holds free inside the process;
``rss_split()`` splits the RSS into held (free pages malloc and pdist's buffer pools keep for
the next step) and allocated (live), as PyTorch reports reserved beside allocated.
"""
import os
import sys
import tracemalloc

from pdist.engine.backend import is_gpu
from pdist.engine.host_memory import malloc_free_bytes, malloc_trim


def _root(a):
    """The array that owns ``a``'s memory (follows ``.base`` through views)."""
    while hasattr(getattr(a, "base", None), "nbytes"):   # (a mapped_empty array's base is its mmap)
        a = a.base
    return a


def unique_nbytes(arrays):
    """Bytes of the distinct buffers behind ``arrays`` (views counted through their
    owner, once). ``None`` entries are skipped."""
    seen, total = set(), 0
    for a in arrays:
        if a is None:
            continue
        r = _root(a)
        if id(r) not in seen:
            seen.add(id(r))
            total += int(r.nbytes)
    return total


def optimizer_arrays(optimizer):
    """Every state array of an optimizer (pdist.optim: ``state[id(p)][name]``)."""
    if optimizer is None:
        return []
    return [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "nbytes")]


def model_state_bytes(model, optimizer=None):
    """{"params_bytes", "grads_bytes", "optim_bytes"} live on this rank.

    ``model`` is a Module (its parameters and their .grad) or a wrapper with
    ``state_arrays() -> (param arrays, grad arrays)`` (pdist.parallel.zero.ZeRO).
    Mixed precision (``master_arrays()``, pdist/parallel/mixed_precision.py): params and
    grads are the low-precision ones; ``optim_bytes`` holds the fp32 masters with Adam's
    m and v (the paper's K = 12 bytes per parameter), and ``master_bytes`` the masters alone."""
    if hasattr(model, "state_arrays"):
        params, grads = model.state_arrays()
    else:
        ps = model.parameters()
        params, grads = [p.data for p in ps], [p.grad for p in ps]
    masters = model.master_arrays() if hasattr(model, "master_arrays") else []
    row = {"params_bytes": unique_nbytes(params), "grads_bytes": unique_nbytes(grads),
           "optim_bytes": unique_nbytes(optimizer_arrays(optimizer) + masters)}
    if masters:
        row["master_bytes"] = unique_nbytes(masters)
    return row


def start_tracing(restart=False):
    """Begin tracing NumPy allocations (no-op on GPU, or if already tracing unless
    ``restart``). Only allocations made after this call are counted: restart it
    right before building a model so that its peak counts its own arrays and not
    those of earlier runs still alive."""
    if is_gpu():  # pragma: no cover - GPU only
        return
    if restart and tracemalloc.is_tracing():
        tracemalloc.stop()
    if not tracemalloc.is_tracing():
        tracemalloc.start()


def stop_tracing():
    if tracemalloc.is_tracing():
        tracemalloc.stop()


def gpu_bytes():
    """(live, pool) bytes on this rank's GPU: ``used_bytes()`` counts the arrays alive now,
    ``total_bytes()`` what CuPy's pool holds (cached free blocks too). (0, 0) on CPU."""
    if not is_gpu():
        return 0, 0
    import cupy
    pool = cupy.get_default_memory_pool()
    return int(pool.used_bytes()), int(pool.total_bytes())


class PeakMemory:
    """``with PeakMemory() as pk: ...`` -> ``pk.peak_bytes``: the most bytes allocated at once
    inside the block. CPU: tracemalloc's peak (starting it if needed). GPU: a
    ``cupy.cuda.MemoryHook`` (pdist/measure/device_memory.py): the live bytes of CuPy arrays
    at entry plus every malloc and minus every free, and their maximum; no pool reset, so
    blocks cached before do not count. On GPU also ``pk.used_bytes`` (live at exit),
    ``pk.total_bytes`` (what the pool holds, cached free blocks included) and ``pk.device``:
    the whole row (pool growth, the driver's mem_info delta and what NCCL/cuBLAS took
    outside the pool)."""

    def __enter__(self):
        self.peak_bytes = None
        if is_gpu():
            from pdist.measure.device_memory import DeviceMemory
            self._dm = DeviceMemory().__enter__()
        else:
            start_tracing()
            tracemalloc.reset_peak()
        return self

    def __exit__(self, *exc):
        if is_gpu():
            self._dm.__exit__(*exc)
            self.device = self._dm.row()
            self.peak_bytes = self.device["peak_bytes"]
            self.used_bytes = self.device["pool_used_bytes"]
            self.total_bytes = self.device["pool_held_bytes"]
        else:
            self.peak_bytes = int(tracemalloc.get_traced_memory()[1])
        return False


def _proc_status(field):
    """``field`` of /proc/self/status in bytes (``VmRSS: 1234 kB``), None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes():
    """The process's resident set size now (VmRSS), None where /proc is missing."""
    return _proc_status("VmRSS")


def rss_peak_bytes():
    """The RSS high-water mark: VmHWM (since the last ``reset_rss_peak``), else
    ``ru_maxrss`` (since the process began; KiB on Linux, bytes on macOS)."""
    hwm = _proc_status("VmHWM")
    if hwm is not None:
        return hwm
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def reset_rss_peak():
    """Set the peak back to the current RSS (Linux: "5" into /proc/self/clear_refs).
    True when it worked, False where it cannot (no /proc, not permitted)."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, b"5")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class RSSPeak:
    """``with RSSPeak() as rp: ...`` -> ``rp.peak_bytes``: the most RSS the process
    held inside the block; ``rp.exact`` False where the peak could not be reset (then
    it is the peak since the process began); ``rp.rss_bytes``: the RSS at exit."""

    def __enter__(self):
        self.exact = reset_rss_peak()
        self.peak_bytes = self.rss_bytes = None
        return self

    def __exit__(self, *exc):
        self.peak_bytes, self.rss_bytes = rss_peak_bytes(), rss_bytes()
        return False


class StepRSS:
    """The RSS of training steps: ``start()`` as a step begins (resets the peak), ``stop()``
    after it; ``row()`` -> {"rss_bytes", "rss_peak_bytes"} of the last step stopped (the peak
    since the process began where it cannot be reset), for ``memory_row(..., rss=...)``."""

    def __init__(self):
        self.rss_bytes = self.rss_peak_bytes = None

    def start(self):
        reset_rss_peak()

    def stop(self):
        self.rss_peak_bytes, self.rss_bytes = rss_peak_bytes(), rss_bytes()

    def row(self):
        return {"rss_bytes": self.rss_bytes, "rss_peak_bytes": self.rss_peak_bytes}


def rss_split():
    """{"rss_bytes", "rss_held_bytes", "rss_allocated_bytes"}: what the process holds now, split
    as PyTorch reports "reserved" beside "allocated". Held: the pages kept free for the next
    step, by malloc (its heap) and by pdist's buffer pools (ZeRO's gathered units and gradients,
    host_memory.BufferPool); allocated = RSS - held, the live memory. Measured by returning
    them (``host_memory.malloc_trim``: RSS before minus after), so the next step faults those
    pages in again: call it outside timed steps. Entries None where /proc is missing."""
    rss = rss_bytes()
    malloc_trim()
    after = rss_bytes()
    if rss is None or after is None:
        return {"rss_bytes": rss, "rss_held_bytes": None, "rss_allocated_bytes": after}
    return {"rss_bytes": rss, "rss_held_bytes": max(rss - after, 0), "rss_allocated_bytes": after}


def process_row():
    """{"rss_bytes", "rss_peak_bytes", "malloc_free_bytes"} of this process now (entries None
    where the platform cannot say)."""
    return {"rss_bytes": rss_bytes(), "rss_peak_bytes": rss_peak_bytes(),
            "malloc_free_bytes": malloc_free_bytes()}


def memory_row(rank, model, optimizer=None, peak_bytes=None, rss=None):
    """One entry of the JSON summary's ``memory_per_rank`` (docs/design.md); ``rss``: a dict
    such as ``process_row()``'s, or {"rss_bytes", "rss_peak_bytes", "rss_baseline_bytes"}."""
    row = {"rank": int(rank), **model_state_bytes(model, optimizer)}
    if peak_bytes is not None:
        row["peak_bytes"] = int(peak_bytes)
    row.update({k: (None if v is None else int(v)) for k, v in (rss or {}).items()})
    return row
