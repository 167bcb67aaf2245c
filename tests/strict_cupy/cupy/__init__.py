"""Strict CPU stand-in for CuPy (tests only; see tests/strict_cupy/README.md)."""
import numbers

import numpy as _np

from cupy._cupy14 import DTYPES, NDARRAY_NOT_IN_CUPY, NOT_IN_CUPY
from cupy._memory import Mem as _Mem, mems as _mems

__version__ = "0.0-strict-standin"
_live, _peak = [0], [0]   # bytes held by live device arrays (the memory pool's used_bytes), their peak
host_reads = [0]     # explicit device -> host copies (.get, .item, asnumpy): each one waits for the GPU


class HostConversionError(TypeError):
    """An implicit device -> host conversion (CuPy would sync or refuse)."""


def _refuse(what):
    raise HostConversionError(f"strict cupy: {what} of a device array is an implicit host transfer; "
                              "use .get() / cupy.asnumpy() (pdist: backend.to_numpy)")


class _Pointer:
    """What ``ndarray.data`` is in CuPy: a MemoryPointer, not an array."""
    __slots__ = ("ptr", "_owner")

    def __init__(self, ptr, owner):
        self.ptr, self._owner = ptr, owner

    def __repr__(self):
        return f"<strict cupy MemoryPointer 0x{self.ptr:x}>"


def _unwrap(x, what="operand"):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _np.ndarray):
        raise TypeError(f"strict cupy: a NumPy array as {what} of a device operation "
                        f"(shape {x.shape}); upload it with cupy.asarray first")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, what) for v in x)
    return x


def _unwrap_index(i):
    if isinstance(i, ndarray):
        return i._a
    if isinstance(i, tuple):
        return tuple(_unwrap_index(v) for v in i)
    return i                       # NumPy arrays are accepted as indices, as CuPy does


def _index_as_cupy(shape, i):
    """An index for the wrapped NumPy array that behaves as CuPy's: an integer device array
    wraps out-of-bounds entries around (``a[[1, 3]]`` of a 3-vector is ``a[[1, 0]]``) where
    NumPy raises, so an unchecked bad token id reads a wrong row silently, as on a GPU."""
    items = i if isinstance(i, tuple) else (i,)
    if any(v is Ellipsis or v is None for v in items):
        return _unwrap_index(i)
    out = tuple(v._a % shape[k] if isinstance(v, ndarray) and v.dtype.kind in "iu" and shape[k]
                else _unwrap_index(v) for k, v in enumerate(items))
    return out if isinstance(i, tuple) else out[0]


def _wrap(r):
    if isinstance(r, _np.ndarray):
        return ndarray._of(r)
    if isinstance(r, _np.generic):
        return ndarray._of(_np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


class ndarray:
    """A device array: NumPy underneath, no implicit way back to the host."""
    __array_ufunc__ = None          # NumPy ufuncs refuse it; numpy-scalar binops defer to us
    __array_priority__ = 1000

    def __init__(self, shape, dtype=float):
        self._set(_np.empty(shape, dtype))

    @classmethod
    def _of(cls, a):
        self = object.__new__(cls)
        self._set(a)
        return self

    def _set(self, a):
        if a.dtype.name not in DTYPES:
            raise ValueError(f"Unsupported dtype {a.dtype}")
        self._a = a
        self._owns = a.base is None
        if self._owns:
            _live[0] += a.nbytes
            _peak[0] = max(_peak[0], _live[0])
            self._mem = _mems[id(a)] = _Mem(a)
        else:
            self._mem = _mems.get(id(a.base))

    def __del__(self):
        if getattr(self, "_owns", False):
            _live[0] -= self._a.nbytes

    # ----------------------------------------------------- refuse the host
    def __array__(self, *a, **k):
        _refuse("__array__ (np.asarray)")

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"strict cupy: numpy.{func.__name__} applied to a device array; "
                        "take the module from the array (pdist.engine.backend.array_module)")

    def __float__(self):
        _refuse("float()")

    def __int__(self):
        _refuse("int()")

    def __index__(self):
        _refuse("operator.index()")

    def __bool__(self):
        _refuse("bool()")

    def __complex__(self):
        _refuse("complex()")

    def tolist(self):
        _refuse(".tolist()")

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self)))

    # ----------------------------------------------------- explicit ways out
    def get(self, stream=None, order="C", out=None, blocking=True):
        host_reads[0] += 1
        cuda._lazy.host_read()           # a copy on the current stream: the host waits for it
        if out is None:
            return self._a.copy()
        if not (isinstance(out, _np.ndarray) and out.shape == self.shape and out.dtype == self.dtype):
            raise ValueError("strict cupy: get(out=) needs a NumPy array of the same shape and dtype")
        out[...] = self._a
        return out

    def item(self):                  # explicit, as in CuPy (a named host sync)
        host_reads[0] += 1
        cuda._lazy.host_read()
        return self._a.item()

    def set(self, arr, stream=None):
        if not isinstance(arr, _np.ndarray):
            raise TypeError("ndarray.set takes a NumPy array")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"strict cupy: set() of shape {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
        self._a[...] = arr

    # ----------------------------------------------------- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: _wrap(self._a.T))
    base = property(lambda self: None if self._a.base is None else _wrap(self._a.base))
    data = property(lambda self: _Pointer(self._a.__array_interface__["data"][0], self))
    device = property(lambda self: cuda.Device(0))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return "strict_cupy." + repr(self._a)

    __str__ = __repr__

    def __getitem__(self, i):
        return _wrap(self._a[_index_as_cupy(self._a.shape, i)])

    def __setitem__(self, i, v):
        self._a[_index_as_cupy(self._a.shape, i)] = _unwrap(v, "a value assigned into a device array")

    def __getattr__(self, name):
        if name.startswith("_") or name in NDARRAY_NOT_IN_CUPY:
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        fn = getattr(self._a, name)
        if not callable(fn):
            return _wrap(fn)

        def method(*args, **kw):
            return _wrap(fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kw.items()}))
        return method

    def __reduce__(self):
        _refuse("pickling")

    def __copy__(self):
        return _wrap(self._a.copy())

    def __deepcopy__(self, memo):
        return _wrap(self._a.copy())


def _binop(name):
    def f(self, other):
        if isinstance(other, _np.ndarray) or not isinstance(other, (ndarray, numbers.Number, _np.generic)):
            if isinstance(other, _np.ndarray):
                _unwrap(other)
            return NotImplemented
        return _wrap(getattr(self._a, name)(_unwrap(other)))
    f.__name__ = name
    return f


def _inplace(name):
    def f(self, other):
        if isinstance(other, _np.ndarray):
            _unwrap(other)
        getattr(self._a, name)(_unwrap(other))
        return self
    f.__name__ = name
    return f


for _n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
           "lshift", "rshift"):
    setattr(ndarray, f"__{_n}__", _binop(f"__{_n}__"))
    setattr(ndarray, f"__r{_n}__", _binop(f"__r{_n}__"))
    setattr(ndarray, f"__i{_n}__", _inplace(f"__i{_n}__"))
for _n in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(ndarray, f"__{_n}__", _binop(f"__{_n}__"))
ndarray.__hash__ = None
for _n in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_n}__", (lambda n: lambda self: _wrap(getattr(self._a, f"__{n}__")()))(_n))


# --------------------------------------------------------------- module API
def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == _np.dtype(dtype) else a.astype(dtype)
    return ndarray._of(_np.array(a, dtype=dtype, order=order or "K", copy=True))


def array(a, dtype=None, copy=True, order="K", ndmin=0):
    if isinstance(a, ndarray):
        return ndarray._of(_np.array(a._a, dtype=dtype, copy=True, order=order, ndmin=ndmin))
    return ndarray._of(_np.array(a, dtype=dtype, copy=True, order=order, ndmin=ndmin))


def asnumpy(a, stream=None, out=None):
    return a.get() if isinstance(a, ndarray) else _np.asarray(a)


def get_array_module(*args):
    import sys
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        _unwrap(a)
    return _wrap(_np.ascontiguousarray(a._a, dtype=dtype))


_PASS = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32", "uint64",
         "bool_", "dtype", "inf", "nan", "pi", "newaxis", "e", "finfo", "iinfo", "result_type", "can_cast",
         "integer", "floating", "number", "generic", "intp", "complex64", "complex128"}


def __getattr__(name):
    if name.startswith("__") or name in NOT_IN_CUPY:
        raise AttributeError(f"module 'cupy' has no attribute {name!r} (CuPy 14.2)")
    obj = getattr(_np, name)
    if name in _PASS or isinstance(obj, type) or not callable(obj):
        return obj
    if name in ("asnumpy", "tolist", "save", "load", "savez"):
        raise AttributeError(name)

    def fn(*args, **kw):
        kw = {k: _unwrap(v, f"argument {k} of cupy.{name}") for k, v in kw.items()}
        return _wrap(obj(*_unwrap(args, f"an argument of cupy.{name}"), **kw))
    fn.__name__ = name
    return fn


from cupy import cuda, random  # noqa: E402,F401


def get_default_memory_pool():
    return cuda._POOL


def get_default_pinned_memory_pool():
    return cuda._POOL
