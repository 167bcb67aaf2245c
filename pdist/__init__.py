"""pdist: distributed training built by hand, to learn it and trust it.

    import pdist
    from pdist import nn, optim
    x = pdist.Tensor(array, requires_grad=True); y = (x @ w).sum(); y.backward(); x.grad
"""
from pdist.engine.autograd import Function, Tensor, is_grad_enabled, no_grad
from pdist.engine import ops as _ops  # noqa: F401  (attaches the operators and methods of Tensor)
from pdist.engine.backend import default_dtype, set_default_dtype, to_numpy, use_device, xp
from pdist.engine import host_memory as _host_memory  # noqa: F401  (tunes malloc on import)

__version__ = "0.1.0"
__all__ = ["Tensor", "Function", "no_grad", "is_grad_enabled", "xp", "to_numpy", "use_device",
           "set_default_dtype", "default_dtype"]
