"""Which transport device (CuPy) arrays take: NCCL, or MPI with host staging.

NCCL up to 2.29 refuses several ranks on one GPU ("Duplicate GPU detected");
2.30+ allows it with ``NCCL_MULTI_RANK_GPU_ENABLE=1``. ``make_backend`` asks the
group's ranks where they run (host, the GPU's PCI bus id) and picks NCCL (nccl.py) unless
ranks share a GPU on an NCCL that refuses it, or NCCL can't be loaded: then MPI
with host staging (host_staging.py). ``PDIST_GPU_TRANSPORT=nccl|mpi-host``
forces one.

This module imports without CuPy (``available()`` is then False).
"""
import os
import sys

from pdist.comm.nccl import NCCLBackend, _nccl, cupy

TRANSPORTS = ("nccl", "mpi-host")
MULTI_RANK_VERSION = 23000          # NCCL 2.30.0: several ranks per GPU with NCCL_MULTI_RANK_GPU_ENABLE=1


def version():
    """NCCL's version code (e.g. 22304 for 2.23.4), or None where NCCL can't be loaded.
    ``from cupy.cuda import nccl`` succeeds even without libnccl (CuPy then sets
    ``nccl.available = False`` and every call fails): this asks the library itself."""
    if _nccl is None or not getattr(_nccl, "available", True):
        return None
    try:
        return int(_nccl.get_version())
    except Exception:  # libnccl missing or broken
        return None


def version_str(code):
    if code is None:
        return "none"
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 10000 else \
        f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def available():
    """True when CuPy with a loadable NCCL is importable and a CUDA device is visible."""
    if version() is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # pragma: no cover - no driver
        return False


def multi_rank_gpu_ok(code=None):
    """Can this NCCL run several ranks on one GPU? Only 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1
    (older ones stop with "Duplicate GPU detected")."""
    code = version() if code is None else code
    return code is not None and code >= MULTI_RANK_VERSION and \
        os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "").strip() == "1"


def choose_transport(shares_gpu, code=None):
    """(transport, reason) for device arrays of a group: ``PDIST_GPU_TRANSPORT=nccl|mpi-host``
    forces one; otherwise NCCL, unless ranks of the group share a GPU on an NCCL that refuses
    it (or NCCL can't be loaded), then MPI with host staging."""
    code = version() if code is None else code
    forced = os.environ.get("PDIST_GPU_TRANSPORT", "").strip().lower()
    if forced and forced != "auto":
        if forced not in TRANSPORTS:
            raise ValueError(f"PDIST_GPU_TRANSPORT={forced!r}: expected one of {TRANSPORTS} or auto")
        return forced, f"PDIST_GPU_TRANSPORT={forced} (NCCL {version_str(code)})"
    if code is None:
        return "mpi-host", "NCCL can't be loaded (libnccl missing): MPI with host staging"
    if shares_gpu and not multi_rank_gpu_ok(code):
        why = ("NCCL <= 2.29 refuses several ranks on one GPU" if code < MULTI_RANK_VERSION else
               "NCCL 2.30+ needs NCCL_MULTI_RANK_GPU_ENABLE=1 for several ranks on one GPU")
        return "mpi-host", f"ranks share a GPU and NCCL {version_str(code)}: {why}; using MPI with host staging"
    return "nccl", f"NCCL {version_str(code)}" + (" with several ranks per GPU" if shares_gpu else "")


_said = set()


def gpu_identity():
    """(host name, PCI bus id) of this rank's GPU: two ranks share a GPU when these are equal.
    The device index alone can't tell: with CUDA_VISIBLE_DEVICES set per rank, index 0 is a
    different GPU on each rank (and two indices can be one GPU under different masks)."""
    import socket
    if cupy is None:
        return socket.gethostname(), "no-gpu"
    dev = cupy.cuda.Device()
    try:
        bus = dev.pci_bus_id
    except Exception:  # pragma: no cover - a driver without the query: the index, as before
        bus = f"index {dev.id}"
    return socket.gethostname(), str(bus).lower()


def make_backend(mpi_comm):
    """The device-array transport of a group (collective over ``mpi_comm``): NCCL, or MPI
    with host staging (``choose_transport``). Prints the choice once per process when
    it is not plain NCCL."""
    where = mpi_comm.allgather(gpu_identity())
    shares = len(set(where)) < len(where)
    transport, why = choose_transport(shares)
    if transport != "nccl" or shares:
        if why not in _said and mpi_comm.Get_rank() == 0:
            _said.add(why)
            print(f"pdist: GPU transport {transport}: {why}", file=sys.stderr, flush=True)
    if transport == "mpi-host":
        from pdist.comm.host_staging import MPIHostBackend
        return MPIHostBackend(mpi_comm)
    return NCCLBackend(mpi_comm)
