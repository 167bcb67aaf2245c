"""cupy.cuda stand-in: devices, streams, events. Work finishes when issued, except NCCL's on a
non-default stream in lazy mode (``STRICT_CUPY_LAZY=1``, _lazy.py)."""
import os
import time

import cupy as _cp
from cupy.cuda import _lazy, runtime  # noqa: F401

_current = [0]


class Device:
    def __init__(self, device=None):
        self.id = _current[0] if device is None else int(device)

    def use(self):
        if not 0 <= self.id < runtime.getDeviceCount():
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id}")
        _current[0] = self.id

    def synchronize(self):
        _lazy.host_sync()

    def __enter__(self):
        self._prev = _current[0]
        self.use()
        return self

    def __exit__(self, *a):
        _current[0] = self._prev

    @property
    def pci_bus_id(self):
        """The physical GPU behind this index: CUDA_VISIBLE_DEVICES maps index i to its i-th entry."""
        vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        phys = int(vis[self.id]) if self.id < len(vis) and vis[self.id].isdigit() else self.id
        return f"0000:{phys:02x}:00.0"


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded, self.disable_timing, self.time, self.pos = False, disable_timing, None, 0

    def record(self, stream=None):
        stream = stream or get_current_stream()
        self.recorded, self.time = True, time.perf_counter()   # compute is synchronous: it ran by now
        self.pos = _lazy.position() if stream.ptr else _lazy.compute_position()   # after what it waits for

    @property
    def done(self):
        """cudaEventQuery: never runs queued work."""
        return _lazy.reached(self.pos)

    def synchronize(self):
        _lazy.run_until(self.pos, host=True)


class Stream:
    _ids = [1]

    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else Stream._ids[0]
        if not null:
            Stream._ids[0] += 1

    def synchronize(self):
        _lazy.host_sync()

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        """Later work on this stream waits for ``event``: the current stream's kernels run at
        once here, so what the event orders runs now (lazy mode)."""
        if self is get_current_stream():
            _lazy.run_until(event.pos)

    @property
    def done(self):
        return _lazy.reached(_lazy.position())

    def use(self):
        if self.ptr:
            _lazy.run_until()          # kernels launched on it run after what it queued
        _stack[-1] = self
        return self

    def __enter__(self):
        if self.ptr:
            _lazy.run_until()
        _stack.append(self)
        return self

    def __exit__(self, *a):
        _stack.pop()


_stack = [Stream(null=True)]


def get_elapsed_time(start_event, end_event):
    """Milliseconds between two recorded events (CuPy raises for unrecorded or non-timing ones)."""
    for ev in (start_event, end_event):
        if not ev.recorded or ev.disable_timing:
            raise runtime.CUDARuntimeError("cudaErrorInvalidResourceHandle: event not recorded or without timing")
    return (end_event.time - start_event.time) * 1e3


def get_current_stream():
    return _stack[-1]


class _Pool:
    def used_bytes(self):
        return _cp._live[0]

    def total_bytes(self):
        return _cp._peak[0]

    def free_all_blocks(self):
        _cp._peak[0] = _cp._live[0]


_POOL = _Pool()


def get_device_id():
    return _current[0]


def _n_devices():
    return int(os.environ.get("STRICT_CUPY_DEVICES", "8"))


from cupy.cuda import nccl  # noqa: E402,F401


from cupy.cuda.memory_hook import MemoryHook  # noqa: E402,F401  (and the hooks into array allocation)
