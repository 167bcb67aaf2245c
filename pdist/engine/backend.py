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


def _bfloat16():
    """``numpy.dtype(ml_dtypes.bfloat16)``, or None without ml_dtypes. Imported on first use:
    ml_dtypes' import costs about 0.6 s of CPU, paid by every rank of every job otherwise."""
    if "bfloat16" not in _state:
        try:
            import ml_dtypes
            _state["bfloat16"] = _np.dtype(ml_dtypes.bfloat16)
        except ImportError:  # pragma: no cover - ml_dtypes is an install requirement
            _state["bfloat16"] = None
    return _state["bfloat16"]


def __getattr__(name):
    """``backend.bfloat16`` and ``backend.LOW_DTYPES``, made on first access (PEP 562)."""
    if name == "bfloat16":
        return _bfloat16()
    if name == "LOW_DTYPES":
        return tuple(d for d in (_bfloat16(), _np.dtype(_np.float16)) if d is not None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_low(dtype):
    """True for the 2-byte floating dtypes (bfloat16, float16): mixed precision's parameters.
    A bfloat16 dtype exists only once ml_dtypes is imported, so this never imports it."""
    try:
        dt = _np.dtype(dtype)
    except TypeError:
        return False
    return dt.itemsize == 2 and (dt == _np.float16 or dt.name == "bfloat16")   # (.name is slow: last)


def words(a):
    """The raw 16-bit words of a 2-byte float array (a ``uint16`` view: MPI has no bfloat16
    type, so such arrays travel as words); any other array unchanged."""
    return a.view(_np.uint16) if is_low(a.dtype) else a


def array_module(a):
    """The array module that owns ``a``: ``cupy`` for a CuPy array, else ``numpy``
    (like ``cupy.get_array_module``). Code that works on a buffer it was given takes
    the module from the buffer, never from the global backend: a NumPy collective
    stays on NumPy when ``PDIST_DEVICE=gpu``, and the reverse."""
    if is_device_array(a):
        return sys.modules[type(a).__module__.split(".")[0]]
    return _np


def set_host_read_guard(fn):
    """``fn()`` runs before every device-to-host read and synchronize: pdist.comm.gpu_sync
    installs a wait on an event under the watchdog's deadline once NCCL is in use."""
    _state["host_read"] = fn


def guard_host_read():
    """Run the host-read guard, if any (before a copy to the host that skips ``to_numpy``)."""
    fn = _state.get("host_read")
    if fn is not None:
        fn()


def synchronize():
    """Wait for the device's queued work (a no-op on CPU): timings of GPU steps
    call it before reading the clock, or they time only the kernel launches."""
    if _state["device"] == "gpu":
        guard_host_read()
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
    guard_host_read()
    end.synchronize()
    return _state["module"].cuda.get_elapsed_time(start, end) / 1e3


def is_device_array(a):
    """True for a CuPy array (lives on a GPU), False for NumPy and scalars."""
    return type(a).__module__.startswith("cupy")


def to_numpy(a):
    """A NumPy array with the values of ``a`` (copies from the GPU if needed, after the
    device's work so far, waited for under a deadline once NCCL is in use)."""
    if is_device_array(a):
        guard_host_read()
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


if device_from_env() == "gpu":
    use_device("gpu")


ONE_HOT_ROWS = 256  # scatter_add on the host: up to this many rows, one GEMM with a one-hot matrix


def scatter_add(a, index, values, exact_rows=False):
    """a[index] += values, adding repeated indices (embedding backward). ``exact_rows``
    (the deterministic mode): each row's values added one by one in the tokens' order
    (``np.add.at``, unbuffered, in index order), a_i = ((a_i + v_1) + v_2) + ..., so a row's
    bits depend on its own values only: neither the
    one-hot GEMM (under OpenBLAS's Haswell sgemm a row's bits depend on how many rows ``a``
    has: a vocabulary-parallel rank's V/t against one process's V) nor reduceat (its sums pair
    the values, so the zeros a vocabulary-parallel rank adds for tokens it does not own move
    the pairs; x + 0 = x keeps the one-by-one sum exact)."""
    if is_device_array(a):  # pragma: no cover - GPU only
        import cupyx
        cupyx.scatter_add(a, index, values)
    elif exact_rows:                                                  # one by one, in token order
        _np.add.at(a, index, values)
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
