"""Never hang on a GPU: the host's waits on the device, and the NCCL communicators' end.

NCCL kernels wait on the GPU for their peers; a peer that never comes (a dead rank, a
mismatched schedule) leaves a kernel spinning, and a host that then blocks in a
``cudaMemcpy`` or ``cudaStreamSynchronize`` behind it blocks forever, out of reach of
pdist's watchdog. So, once a group has an NCCL communicator:

* every device-to-host read (``backend.to_numpy``) and ``backend.synchronize()`` first
  records an event on the current stream and polls it (cudaEventQuery) under the
  watchdog's deadline (``watchdog.poll``: ``PDIST_TIMEOUT``, the control channel);
* on a timeout (or a failed or exited peer) every NCCL communicator of this process is
  aborted (``ncclCommAbort``, newest first: the stuck kernels return) before the
  watchdog's ``CollectiveTimeoutError`` is raised;
* at exit (``atexit``, registered by ``comm.init`` so it runs before the exit handshake of
  failures.py), the communicators are destroyed newest first (sub-groups before the world
  group they were split from), each after its stream's queued work completed under the
  deadline (``ncclCommDestroy`` waits for it without one); a communicator whose work does
  not complete is aborted instead, with a message.

Only NCCL registers here: host staging's waits are MPI's, which already have deadlines.
"""
import sys
import weakref

from pdist.comm import watchdog

_backends = []        # weakrefs to NCCLBackends, in creation order
_state = {"aborted": False}


def register(be):
    """Called by NCCLBackend.__init__: guard host reads from now on."""
    from pdist.engine import backend
    _backends.append(weakref.ref(be))
    backend.set_host_read_guard(wait_current_stream)


def live():
    """The NCCLBackends of this process still alive, in creation order."""
    return [b for b in (r() for r in _backends) if b is not None]


def wait_event(event, what="a device-to-host read"):
    """Poll ``event`` until it is done, under the watchdog's deadline; on a timeout abort
    every NCCL communicator, then raise the watchdog's error (it names ``what``)."""
    if event.done:
        return
    try:
        watchdog.poll(lambda: event.done)
    except watchdog.CollectiveTimeoutError as e:
        abort_all()
        raise watchdog.CollectiveTimeoutError(f"{what} waited for the GPU, whose NCCL work did not complete "
                                              f"(communicators aborted): {e}", e.reason) from e


def wait_current_stream():
    """Before the host blocks on the device: the current stream's work so far, with a deadline."""
    import cupy
    ev = cupy.cuda.Event(disable_timing=True)
    ev.record(cupy.cuda.get_current_stream())
    wait_event(ev)


def abort_all():
    """ncclCommAbort on every live communicator, newest first (once)."""
    if _state["aborted"]:
        return
    _state["aborted"] = True
    for be in reversed(live()):
        try:
            be.nc.abort()
        except Exception as e:  # pragma: no cover - a driver already gone
            print(f"pdist: ncclCommAbort of group of {be.size} failed: {e}", file=sys.stderr, flush=True)


def destroy_all():
    """At exit: destroy the communicators newest first, each after its stream's work."""
    bes = live()
    if _state["aborted"] or not bes:
        return
    import cupy
    for be in reversed(bes):
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(be.stream)
        try:
            wait_event(ev, f"the exit of an NCCL communicator of {be.size} ranks")
        except watchdog.CollectiveTimeoutError as e:
            print(f"pdist: {e}", file=sys.stderr, flush=True)
            return
        be.nc.destroy()
    _backends.clear()
