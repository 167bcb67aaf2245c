"""Process groups and collectives over MPI (NumPy arrays) and NCCL (CuPy arrays).

    from pdist import comm
    world = comm.init()                   # works under mpirun and as one plain process
    world.all_reduce(grad, op="avg")      # in place; algorithm="mpi" | "naive" | "ring"
    mesh = comm.DeviceMesh(dp=2, tp=2)    # world -> dp / tp / pp sub-groups

``init()`` starts MPI once (idempotent), sets BLAS threads per rank to
``max(1, cores // ranks on this node)`` and turns on cooperative waits when
ranks outnumber cores (mpi.py). See docs/collectives.md.
"""
from pdist.comm.algorithms import chunk_bounds
from pdist.comm.check import CollectiveMismatchError
from pdist.comm.group import ProcessGroup
from pdist.comm.mesh import DeviceMesh
from pdist.comm.work import Work

__all__ = ["init", "get_world", "ProcessGroup", "DeviceMesh", "Work", "chunk_bounds",
           "CollectiveMismatchError", "is_initialized"]

_world = {"group": None}


def init(device=None):
    """The world ProcessGroup (created on the first call; later calls return it).

    ``device`` ("cpu" or "gpu") also selects the array backend
    (``pdist.backend.use_device``): CuPy arrays then travel over NCCL."""
    if device is not None:
        from pdist.backend import use_device
        use_device(device)
    if _world["group"] is None:
        from pdist.comm.mpi import MPI, setup
        setup(MPI.COMM_WORLD)
        _world["group"] = ProcessGroup(MPI.COMM_WORLD.Dup(), "world")
    return _world["group"]


def get_world():
    """The world group (calls ``init()`` if nobody has yet)."""
    return _world["group"] or init()


_step = {"step": 0}


def set_step(step):
    """The training step this process is in (stamped into every collective's check)."""
    _step["step"] = int(step)


def get_step():
    return _step["step"]


def is_initialized():
    return _world["group"] is not None
