"""Device allocations of the stand-in: who holds them, and poisoning (cuda/_lazy.py)."""
import weakref

mems = weakref.WeakValueDictionary()   # id(owning NumPy array) -> its _Mem


class Mem:
    """One device allocation, held by every array (owner or view) on it. When the last goes
    while queued stream work still touches it, the bytes are poisoned (cuda/_lazy.py)."""
    __slots__ = ("a", "__weakref__")

    def __init__(self, a):
        self.a = a

    def __del__(self):
        try:
            from cupy.cuda import _lazy
        except ImportError:          # interpreter shutdown
            return
        a = self.a
        if _lazy._queue and _lazy.touched(a.__array_interface__["data"][0], a.nbytes):
            _lazy.poison(a)
