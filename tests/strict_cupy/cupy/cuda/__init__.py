"""cupy.cuda stand-in: devices, streams, events (all synchronous: work finishes when issued)."""
import os
import time

import cupy as _cp
from cupy.cuda import runtime  # noqa: F401

_current = [0]


class Device:
    def __init__(self, device=None):
        self.id = _current[0] if device is None else int(device)

    def use(self):
        if not 0 <= self.id < runtime.getDeviceCount():
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id}")
        _current[0] = self.id

    def synchronize(self):
        pass

    def __enter__(self):
        self._prev = _current[0]
        self.use()
        return self

    def __exit__(self, *a):
        _current[0] = self._prev

    @property
    def pci_bus_id(self):
        return f"0000:{self.id:02x}:00.0"


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded, self.disable_timing, self.time = False, disable_timing, None

    def record(self, stream=None):
        self.recorded, self.time = True, time.perf_counter()   # work is synchronous: it ran by now

    @property
    def done(self):
        return True

    def synchronize(self):
        pass


class Stream:
    _ids = [1]

    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else Stream._ids[0]
        if not null:
            Stream._ids[0] += 1

    def synchronize(self):
        pass

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        pass

    @property
    def done(self):
        return True

    def use(self):
        _stack[-1] = self
        return self

    def __enter__(self):
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
