"""Process groups and collectives over MPI (NumPy arrays) and NCCL (CuPy arrays).

    from pdist import comm
    world = comm.init()                   # works under mpirun and as one plain process
    world.all_reduce(grad, op="avg")      # in place; algorithm="mpi" | "naive" | "ring"
    mesh = comm.DeviceMesh(dp=2, tp=2)    # world -> dp / tp / pp sub-groups
    comm.set_step(k)                      # training step: part of every fingerprint

``init()`` starts MPI once (idempotent), sets BLAS threads per rank to
``max(1, cores // ranks on this node)`` unless the user set OMP/OPENBLAS/MKL
_NUM_THREADS, turns on cooperative waits when ranks outnumber cores (mpi.py),
starts the watchdog (every wait has a deadline, watchdog.py) and installs the
failure hooks (a failure on any rank ends the job, failures.py); the world
group lives in world.py. See docs/collectives.md and docs/failures.md.
"""
from pdist.comm.algorithms import chunk_bounds
from pdist.comm.check import CollectiveMismatchError
from pdist.comm.flight_recorder import get_step, set_step
from pdist.comm.group import ProcessGroup
from pdist.comm.mesh import DeviceMesh
from pdist.comm.watchdog import CollectiveTimeoutError
from pdist.comm.work import Work
from pdist.launcher import WorldSizeError
from pdist.comm.world import default_group, get_world, init, is_initialized, self_group

__all__ = ["init", "get_world", "default_group", "ProcessGroup", "DeviceMesh", "Work", "chunk_bounds",
           "CollectiveMismatchError", "CollectiveTimeoutError", "is_initialized",
           "set_step", "get_step", "self_group", "WorldSizeError"]
