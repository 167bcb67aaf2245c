"""The world group: ``init()`` once per process, then ``get_world()`` and ``self_group()``.

``init()`` starts MPI once (idempotent), checks that the world is the one the launcher
started (pdist/launcher.py: else ``WorldSizeError`` on every process), sets BLAS threads per rank to
``max(1, cores // ranks on this node)`` unless the user set OMP/OPENBLAS/MKL
_NUM_THREADS, turns on cooperative waits when ranks outnumber cores (mpi.py), gathers each
rank's hostname (which node it runs on, nodes.py),
starts the watchdog (every wait has a deadline, watchdog.py), installs the
failure hooks (a failure on any rank ends the job, failures.py) and, at exit, the
destruction of the NCCL communicators, newest first (gpu_sync.py). The package
(``pdist.comm``) re-exports all four functions.
"""
from pdist.comm.group import ProcessGroup

_world = {"group": None}


def init(device=None, timeout=None):
    """The world ProcessGroup (created on the first call; later calls return it).

    ``device`` ("cpu" or "gpu") also selects the array backend
    (``pdist.engine.backend.use_device``): CuPy arrays then travel over NCCL.
    ``timeout`` (seconds) is the default deadline of every wait; the
    environment variable ``PDIST_TIMEOUT`` wins when set (default 600)."""
    if device is not None:
        from pdist.engine.backend import use_device
        use_device(device)
    from pdist.comm import failures, watchdog
    if _world["group"] is None:
        from pdist.measure import trace
        from pdist.comm.mpi import MPI, local_size, setup
        from pdist.launcher import check_world, world_check_on
        w = MPI.COMM_WORLD
        if world_check_on():                 # the world the launcher started, or a WorldSizeError
            check_world(w.Get_size(), w.Get_rank(), local_size(w))
        setup(w)
        from pdist.comm import nodes
        nodes.gather(w)                      # each rank's hostname: which node it is on (nodes.py)
        watchdog.configure(timeout)
        _world["group"] = ProcessGroup(MPI.COMM_WORLD.Dup(), "world")
        trace.set_world(_world["group"])
        failures.install()
        import atexit
        from pdist.comm import gpu_sync
        atexit.register(gpu_sync.destroy_all)   # before failures' exit handshake (atexit: last in, first out)
    elif timeout is not None:
        watchdog.configure(timeout)
    return _world["group"]


def get_world():
    """The world group (calls ``init()`` if nobody has yet)."""
    return _world["group"] or init()


def self_group():
    """This process alone as a ProcessGroup (made without any collective: a rank can
    hold a whole model by itself, e.g. a single-process checkpoint load)."""
    if _world.get("self") is None:
        from pdist.comm.mpi import MPI
        _world["self"] = ProcessGroup(MPI.COMM_SELF.Dup(), "self")
    return _world["self"]


def default_group(group):
    """``group``, or the world group when it is None (the one place that defaults a group:
    the strategies and the tensor-parallel layers call it)."""
    return get_world() if group is None else group


def is_initialized():
    return _world["group"] is not None
