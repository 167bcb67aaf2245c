"""The array backend: one object, ``xp``, that is NumPy or CuPy.

Every module writes ``from pdist.engine.backend import xp`` and calls ``xp.zeros``,
``xp.matmul``, ... . ``xp`` forwards to NumPy by default and to CuPy after
``use_device("gpu")`` or when the environment says ``PDIST_DEVICE=gpu``, so no
algorithm file ever branches on NumPy vs CuPy (docs/design.md).

    PDIST_DEVICE=gpu mpirun -n 4 python lessons/03_zero.py

places rank r on GPU ``local_rank % n_gpus``. ``PDIST_DEVICE`` is ``cpu`` (the default)
or ``gpu``, any case; any other value stops the import with a ValueError, and
``gpu`` where CuPy sees no driver or GPU stops it with a RuntimeError saying so. Host-side code that needs a NumPy
array (printing, files, comparisons) calls ``to_numpy(a)``.

The default floating dtype is float32 (``set_default_dtype("float64")`` for the
equivalence tests and for finite differences).
"""
import os
import sys

import numpy as _np

_state = {"module": _np, "device": "cpu", "dtype": _np.dtype("float32")}


class _XP:
    """Forwards attribute access to the active array module (numpy or cupy)."""

    def __getattr__(self, name):
        return getattr(_state["module"], name)

    def __repr__(self):
        return f"<pdist xp -> {_state['module'].__name__}>"


xp = _XP()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name, default):
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off (any case);
    ``default`` when unset or empty. Anything else raises a ValueError that names
    the variable and the values it accepts."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return bool(default)
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of 0/1/false/true/no/yes/off/on")


def local_rank():
    """This process's rank among the ranks on its node (MPICH, Open MPI, Slurm)."""
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def use_device(device):
    """Choose ``"cpu"`` (NumPy) or ``"gpu"`` (CuPy on GPU ``local_rank % n_gpus``).

    ``"gpu"`` without CuPy, or with CuPy but no usable CUDA driver/GPU, raises a
    RuntimeError that says so (not a raw CUDA error from deep inside CuPy)."""
    if device == "cpu":
        _state.update(module=_np, device="cpu")
        return
    if device != "gpu":
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError("PDIST_DEVICE=gpu needs CuPy: pip install 'pdist[gpu]'") from e
    cuda_error = getattr(cupy.cuda.runtime, "CUDARuntimeError", RuntimeError)
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except (cuda_error, RuntimeError, OSError, ImportError) as e:  # no driver, no libcudart, ...
        raise RuntimeError(f"PDIST_DEVICE=gpu but CuPy finds no CUDA driver/GPU: {e} "
                           "(set PDIST_DEVICE=cpu to run on NumPy)") from e
    if n == 0:
        raise RuntimeError("PDIST_DEVICE=gpu but CuPy finds no CUDA driver/GPU: 0 devices visible "
                           "(check CUDA_VISIBLE_DEVICES; set PDIST_DEVICE=cpu to run on NumPy)")
    lr = local_rank()
    if lr >= n:
        _warn_shared_gpu(lr, n)
    cupy.cuda.Device(lr % n).use()
    _state.update(module=cupy, device="gpu", gpu_index=lr % n, gpu_count=n)


_warned = set()


def _warn_shared_gpu(lr, n):
    """Once per process: more ranks on this node than GPUs, so ranks share a GPU."""
    if "shared" in _warned:
        return
    _warned.add("shared")
    import warnings
    warnings.warn(f"pdist: local rank {lr} but only {n} GPU(s) visible: rank {lr} shares GPU {lr % n} "
                  f"(local_rank % {n}) with other ranks; their memory and compute add up there, and NCCL "
                  "<= 2.29 refuses several ranks on one GPU (pdist then stages through the host over MPI, "
                  "docs/gpu.md)", RuntimeWarning, stacklevel=3)


def shared_gpu():
    """True when this node runs more ranks than it has visible GPUs (several ranks per GPU).
    Local size comes from the launcher's environment; False on CPU."""
    if _state["device"] != "gpu":
        return False
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]) > _state.get("gpu_count", 1)
    return False


def device_from_env():
    """The device named by ``PDIST_DEVICE``: ``"cpu"`` (also when unset or empty)
    or ``"gpu"``, any case, surrounding spaces ignored. Any other value raises a
    ValueError naming the variable and the accepted values (a typo such as
    ``PDIST_DEVICE=cuda`` must not silently train on the CPU)."""
    raw = os.environ.get("PDIST_DEVICE", "")
    value = raw.strip().lower()
    if value in ("", "cpu", "gpu"):
        return value or "cpu"
    raise ValueError(f"PDIST_DEVICE={raw!r}: expected 'cpu' or 'gpu' (any case)")


def device():
    return _state["device"]


def is_gpu():
    return _state["device"] == "gpu"


def set_default_dtype(dtype):
    dt = _np.dtype(dtype)
    if dt not in (_np.float32, _np.float64):
        raise ValueError(f"default dtype must be float32 or float64, got {dt}")
    _state["dtype"] = dt


def default_dtype():
    return _state["dtype"]


def array_module(a):
    """The array module that owns ``a``: ``cupy`` for a CuPy array, else ``numpy``
    (like ``cupy.get_array_module``). Code that works on a buffer it was given takes
    the module from the buffer, never from the global backend: a NumPy collective
    stays on NumPy when ``PDIST_DEVICE=gpu``, and the reverse."""
    if is_device_array(a):
        return sys.modules[type(a).__module__.split(".")[0]]
    return _np


def synchronize():
    """Wait for the device's queued work (a no-op on CPU): timings of GPU steps
    call it before reading the clock, or they time only the kernel launches."""
    if _state["device"] == "gpu":
        _state["module"].cuda.get_current_stream().synchronize()


def device_event():
    """A CUDA event recorded now on the current stream (GPU), or None on CPU. Two of them
    bracket device work; ``elapsed_seconds`` reads the device time between them."""
    if _state["device"] != "gpu":
        return None
    ev = _state["module"].cuda.Event()
    ev.record()
    return ev


def elapsed_seconds(start, end):
    """Seconds of device time between two ``device_event()``s (waits for ``end``)."""
    end.synchronize()
    return _state["module"].cuda.get_elapsed_time(start, end) / 1e3


def is_device_array(a):
    """True for a CuPy array (lives on a GPU), False for NumPy and scalars."""
    return type(a).__module__.startswith("cupy")


def to_numpy(a):
    """A NumPy array with the values of ``a`` (copies from the GPU if needed)."""
    if is_device_array(a):
        return a.get()
    return _np.asarray(a)


def to_device(a):
    """A NumPy array moved to the active device (a copy on GPU, ``a`` itself on CPU);
    anything else (a Tensor, a device array, None) unchanged."""
    if isinstance(a, _np.ndarray) and _state["device"] == "gpu":
        return _state["module"].asarray(a)
    return a


def asarray(a, dtype=None):
    """``a`` as an array of the active backend (uploads NumPy arrays to the GPU)."""
    return _state["module"].asarray(a, dtype=dtype)


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
    mod = _state["module"]
    dt = _np.dtype(dtype)
    if mod is not _np or n * dt.itemsize < 1 << 16:
        return mod.empty(n, dtype=dt)
    import ctypes
    import mmap
    import tracemalloc
    import weakref
    m = mmap.mmap(-1, n * dt.itemsize)
    a = _np.frombuffer(m, dtype=dt)                                    # (n,), writable, zeros
    if tracemalloc.is_tracing():
        addr, api = a.__array_interface__["data"][0], ctypes.pythonapi
        api.PyTraceMalloc_Track.argtypes = [ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t]
        api.PyTraceMalloc_Untrack.argtypes = [ctypes.c_uint, ctypes.c_size_t]
        api.PyTraceMalloc_Track(_NUMPY_TRACE_DOMAIN, addr, n * dt.itemsize)
        weakref.finalize(m, api.PyTraceMalloc_Untrack, _NUMPY_TRACE_DOMAIN, addr)
    return a


def malloc_trim():
    """Return the free pages malloc holds to the OS (glibc ``malloc_trim(0)``: the heap's
    top and every free page inside it). The RSS then counts live memory only; pdist.measure.memory
    reads RSS after it where a measurement needs that. False where there is no glibc."""
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

if device_from_env() == "gpu":
    use_device("gpu")


ONE_HOT_ROWS = 256  # scatter_add on the host: up to this many rows, one GEMM with a one-hot matrix


def scatter_add(a, index, values):
    """a[index] += values, adding repeated indices (embedding backward)."""
    if is_device_array(a):  # pragma: no cover - GPU only
        import cupyx
        cupyx.scatter_add(a, index, values)
    elif (a.ndim == 2 and getattr(index, "ndim", 0) == 1 and index.dtype.kind in "iu"
          and getattr(values, "shape", None) == (index.shape[0], a.shape[1])):
        # rows: sort the indices (stably), sum each run of equal rows in one pass
        # (np.add.reduceat), add once per distinct row; ~4x faster than np.add.at here
        order = _np.argsort(index, kind="stable")
        rows = index[order]
        if rows.size and rows[0] < 0:  # negative indices could alias rows: the general path
            _np.add.at(a, index, values)
        elif a.shape[0] <= ONE_HOT_ROWS and a.dtype.kind == "f" and a.dtype.itemsize >= 4:
            # few rows (a small vocabulary, the positions): a += onehot(index)^T values, one
            # GEMM of (rows, N) x (N, C); reduceat down axis 0 runs at ~5 ns per element
            onehot = _np.zeros((a.shape[0], index.shape[0]), dtype=a.dtype)  # (rows, N)
            onehot[index, _np.arange(index.shape[0])] = 1
            a += onehot @ values.astype(a.dtype, copy=False)
        elif rows.size:
            starts = _np.flatnonzero(_np.r_[True, rows[1:] != rows[:-1]])
            a[rows[starts]] += _np.add.reduceat(values[order], starts, axis=0)
    else:
        _np.add.at(a, index, values)
