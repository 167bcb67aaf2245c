"""cupy.cuda.runtime stand-in."""
import os


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount():
    n = os.environ.get("STRICT_CUPY_DEVICES", "8")
    if n == "nodriver":
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    return int(n)


def deviceSynchronize():
    from cupy.cuda import _lazy
    _lazy.host_sync()


def getDeviceProperties(i):
    return {"name": b"strict-cupy stand-in", "totalGlobalMem": 80 << 30, "multiProcessorCount": 1}
