"""cupy.cuda.MemoryHook stand-in, with CuPy 14's contract (cupy/cuda/memory_hook.pyx):
hooks registered by ``with hook:`` (a stack per thread, by ``name``) get
``malloc_preprocess/postprocess(device_id, size, mem_size[, mem_ptr, pmem_id])`` for every
array taken from the pool, ``alloc_preprocess/postprocess(device_id, mem_size[, mem_ptr])``
only when the pool must grow (no cached block is big enough), and
``free_preprocess/postprocess(device_id, mem_size, mem_ptr, pmem_id)`` when an array's memory
goes back to the pool. Sizes are rounded up to CuPy's 512-byte blocks. The pool held here is
the high-water mark of live bytes (as ``cupy.get_default_memory_pool().total_bytes()``).
Also ``runtime.memGetInfo()`` -> (free, total) of a 141 GiB device, where the pool's blocks
and ``outside_bytes[0]`` (what NCCL/cuBLAS would take) are in use."""
import threading

import cupy as _cp
from cupy.cuda import runtime as _runtime

ROUND = 512
TOTAL = 141 * 2 ** 30
outside_bytes = [0]
_local = threading.local()
_held = [0]


def get_memory_hooks():
    if not hasattr(_local, "hooks"):
        _local.hooks = {}
    return _local.hooks


class MemoryHook:
    name = "MemoryHook"

    def __enter__(self):
        hooks = get_memory_hooks()
        if self.name in hooks:
            raise RuntimeError(f"MemoryHook {self.name!r} already exists")
        hooks[self.name] = self
        return self

    def __exit__(self, *exc):
        del get_memory_hooks()[self.name]

    def alloc_preprocess(self, **kw):
        pass

    def alloc_postprocess(self, **kw):
        pass

    def malloc_preprocess(self, **kw):
        pass

    def malloc_postprocess(self, **kw):
        pass

    def free_preprocess(self, **kw):
        pass

    def free_postprocess(self, **kw):
        pass


def _rounded(n):
    return -(-n // ROUND) * ROUND


def _call(method, **kw):
    for h in list(get_memory_hooks().values()):
        getattr(h, method)(**kw)


_orig_set, _orig_del = _cp.ndarray._set, _cp.ndarray.__del__


def _set(self, a):
    owns = a.base is None
    size, mem = a.nbytes, _rounded(a.nbytes)
    hooked = owns and get_memory_hooks()
    if hooked:
        _call("malloc_preprocess", device_id=0, size=size, mem_size=mem)
    grow = owns and _cp._live[0] + mem > _held[0]
    if hooked and grow:
        _call("alloc_preprocess", device_id=0, mem_size=mem)
    _orig_set(self, a)
    if owns:
        self._hook_mem = mem
        ptr = a.__array_interface__["data"][0]
        if grow:
            _held[0] = _cp._live[0] - size + mem
            if hooked:
                _call("alloc_postprocess", device_id=0, mem_size=mem, mem_ptr=ptr)
        if hooked:
            _call("malloc_postprocess", device_id=0, size=size, mem_size=mem, mem_ptr=ptr, pmem_id=id(a))


def _del(self):
    mem = getattr(self, "_hook_mem", None)
    if mem is not None and get_memory_hooks():
        ptr = self._a.__array_interface__["data"][0]
        _call("free_preprocess", device_id=0, mem_size=mem, mem_ptr=ptr, pmem_id=id(self._a))
        _orig_del(self)
        _call("free_postprocess", device_id=0, mem_size=mem, mem_ptr=ptr, pmem_id=id(self._a))
    else:
        _orig_del(self)


_cp.ndarray._set, _cp.ndarray.__del__ = _set, _del


def _mem_get_info():
    used = max(_held[0], _cp.get_default_memory_pool().total_bytes()) + outside_bytes[0]
    return TOTAL - used, TOTAL


if not hasattr(_runtime, "memGetInfo"):
    _runtime.memGetInfo = _mem_get_info
