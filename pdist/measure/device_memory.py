"""What a GPU's memory holds, from CuPy itself: live bytes and their high-water mark from a
``cupy.cuda.MemoryHook``, beside the pool's held bytes and the driver's ``mem_info``.

    with DeviceMemory() as dm:        # registers the hook (this thread's allocations)
        train_step()
    dm.row()    # {"live_bytes", "peak_bytes", "pool_held_bytes", "device_used_bytes", ...}

Three counts, three questions:

    live_bytes       Σ mem_size of the arrays alive now: at entry ``pool.used_bytes()``, then
                     + every malloc and - every free the hook sees (CuPy rounds each array up
                     to 512-byte blocks: mem_size, the bytes the pool reserves for it)
    peak_bytes       max of live_bytes over the block: the most bytes of live arrays at once
                     (what must fit on the device), sampled at every allocation, not polled
    pool_held_bytes  ``pool.total_bytes()``: live arrays plus the freed blocks CuPy caches
    device_used_bytes  total - free of ``cudaMemGetInfo``: everything this device holds (the
                     pool, the CUDA context, cuBLAS workspaces, NCCL's buffers; other
                     processes on the same GPU too)

and their deltas over the block: ``pool_growth_bytes`` (new blocks the pool took from the
device: the hook's alloc events), ``outside_pool_bytes`` = device-used delta - pool-held
delta (what NCCL communicators, cuBLAS handles and the context took on their own; may be
negative when another process on the GPU freed memory meanwhile).

The hook sees the allocations of the thread that entered it (CuPy's hooks are per thread).
Entry and exit synchronize the device, so the driver's counts include queued work."""

_HOOK = {}


def _hook_class():
    """A ``cupy.cuda.MemoryHook`` subclass counting live bytes (made once, on first use)."""
    if "cls" not in _HOOK:
        import cupy

        class LiveBytes(cupy.cuda.MemoryHook):
            """live += mem_size at each malloc, -= at each free; peak = max live; grown =
            bytes the pool newly took from the device (alloc events)."""
            name = "pdist.LiveBytes"

            def __init__(self, live=0):
                self.live = self.peak = live
                self.grown = self.mallocs = 0

            def malloc_postprocess(self, device_id=None, size=0, mem_size=0, mem_ptr=0, pmem_id=0, **kw):
                if mem_ptr:
                    self.live += mem_size
                    self.mallocs += 1
                    self.peak = max(self.peak, self.live)

            def free_postprocess(self, device_id=None, mem_size=0, mem_ptr=0, pmem_id=0, **kw):
                self.live -= mem_size

            def alloc_postprocess(self, device_id=None, mem_size=0, mem_ptr=0, **kw):
                if mem_ptr:
                    self.grown += mem_size

        _HOOK["cls"] = LiveBytes
    return _HOOK["cls"]


def snapshot():
    """{"pool_used_bytes", "pool_held_bytes", "device_used_bytes", "device_total_bytes"} now
    (the device synchronized first); device_* None where the runtime cannot say."""
    import cupy
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    row = {"pool_used_bytes": int(pool.used_bytes()), "pool_held_bytes": int(pool.total_bytes()),
           "device_used_bytes": None, "device_total_bytes": None}
    try:
        free, total = cupy.cuda.runtime.memGetInfo()
        row.update(device_used_bytes=int(total - free), device_total_bytes=int(total))
    except (AttributeError, RuntimeError):  # no memGetInfo (a stand-in), or the driver refused
        pass
    return row


class DeviceMemory:
    """``with DeviceMemory() as dm:`` counts the block's device memory (module docstring).
    ``dm.live_bytes`` / ``dm.peak_bytes`` are readable inside the block too (the hook's counts,
    no synchronization); ``dm.row()`` after it. Nested blocks work (each hook has its name)."""
    _n = [0]

    def __enter__(self):
        self.start = snapshot()
        self._hook = _hook_class()(self.start["pool_used_bytes"])
        DeviceMemory._n[0] += 1
        self._hook.name = f"pdist.LiveBytes.{DeviceMemory._n[0]}"
        self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        self._hook.__exit__(*exc)
        self.end = snapshot()
        return False

    live_bytes = property(lambda self: int(self._hook.live))
    peak_bytes = property(lambda self: int(self._hook.peak))

    def row(self):
        """The block's counts: live, peak (MemoryHook), pool and device, with their deltas."""
        s, e = self.start, self.end
        row = {"live_bytes": self.live_bytes, "peak_bytes": self.peak_bytes,
               "block_peak_bytes": self.peak_bytes - s["pool_used_bytes"], "mallocs": int(self._hook.mallocs),
               "pool_used_bytes": e["pool_used_bytes"], "pool_held_bytes": e["pool_held_bytes"],
               "pool_growth_bytes": int(self._hook.grown),
               "pool_held_delta_bytes": e["pool_held_bytes"] - s["pool_held_bytes"],
               "device_used_bytes": e["device_used_bytes"], "device_total_bytes": e["device_total_bytes"],
               "device_used_delta_bytes": None, "outside_pool_bytes": None}
        if s["device_used_bytes"] is not None and e["device_used_bytes"] is not None:
            d = e["device_used_bytes"] - s["device_used_bytes"]
            row.update(device_used_delta_bytes=d, outside_pool_bytes=d - row["pool_held_delta_bytes"])
        return row


__all__ = ["DeviceMemory", "snapshot"]
