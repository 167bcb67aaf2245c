"""Reverse-mode automatic differentiation over ``xp`` arrays.

A ``Tensor`` holds an array (``.data``), and, when it was computed from tensors
that require gradients, the ``Function`` that made it (``._ctx``). Calling
``loss.backward()`` walks that graph once in reverse topological order and
applies the chain rule

    dL/dx_i = sum over uses y = f(..., x_i, ...) of  (dy/dx_i)^T dL/dy

so each Function only needs a ``backward(grad_out) -> grads_in``. The walk
itself (the order, the gradient sums, the leaves, the hooks firing) is
``pdist.engine.backprop``.

Contracts (PyTorch's):

* Gradients **accumulate**: ``backward()`` adds into ``leaf.grad`` (in place when
  a gradient array already exists, so a ``.grad`` that is a view into a flat
  buffer stays that view), until ``zero_grad()`` sets it to ``None``. This is
  what makes gradient accumulation over micro-batches work.
* ``register_hook(fn)`` on any tensor: ``fn(grad)`` runs when the gradient with
  respect to that tensor is complete, before it flows further back; it may
  return a replacement gradient. ``register_post_accumulate_grad_hook(fn)`` on a
  leaf: ``fn(tensor)`` runs right after ``tensor.grad`` received its last
  contribution of this backward (DDP/ZeRO start their reductions here).
* Functions read parameters through their parent tensors at backward time
  (``self.parents[i].data``), never through arrays captured in forward, so a
  sharded strategy (ZeRO-3) may free a parameter's full array after forward and
  gather it again before backward.
* ``with no_grad():`` builds no graph.

The operators and array methods of ``Tensor`` (``x @ w``, ``.sum()``,
``.reshape``, ...) are attached by ``pdist.engine.ops`` when it is imported; the
package (``pdist/__init__``) imports both, so importing any pdist module gives
the full ``Tensor``. This module imports nothing from ``pdist.engine.ops`` (no cycle).
"""
import contextlib

from pdist.engine.backend import xp
from pdist.engine.backprop import run_backward
from pdist.engine.split_backward import run_backward_input

_grad_enabled = [True]
_swapped = {}            # Function class -> the class that runs in its place (``substitute``)


@contextlib.contextmanager
def no_grad():
    """Inside this block, operations record no graph (like torch.no_grad)."""
    prev = _grad_enabled[0]
    _grad_enabled[0] = False
    try:
        yield
    finally:
        _grad_enabled[0] = prev


def is_grad_enabled():
    return _grad_enabled[0]


@contextlib.contextmanager
def substitute(table):
    """Inside this block ``Op.apply`` runs ``table[Op]`` in Op's place: a subclass that takes the
    same inputs and computes the same function another way (PyTorch's function modes swap
    kernels the same way). A mode applied from outside brings its own kernels this way, so
    no op names it. Blocks nest; the inner table wins."""
    prev = dict(_swapped)
    _swapped.update(table)
    try:
        yield
    finally:
        _swapped.clear()
        _swapped.update(prev)


class Tensor:
    """An array plus what is needed to differentiate through it."""

    __array_priority__ = 1000  # so ndarray <op> Tensor defers to Tensor
    transient_grad = False     # True: zero_grad drops .grad even with set_to_none=False (precision.py)

    def __init__(self, data, requires_grad=False, dtype=None, name=None):
        if isinstance(data, Tensor):
            data = data.data
        if dtype is None and not hasattr(data, "dtype"):
            from pdist.engine.backend import default_dtype
            dtype = default_dtype()
        self.data = xp.asarray(data, dtype=dtype)
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._ctx = None
        self._hooks = None
        self._post_acc_hooks = None
        self.name = name

    @classmethod
    def _make(cls, data, requires_grad):
        t = cls.__new__(cls)
        t.data, t.grad, t.requires_grad = data, None, requires_grad
        t._ctx = t._hooks = t._post_acc_hooks = t.name = None
        return t

    # --- array-like facts -------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self._ctx is None)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        g = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{g})"

    def numpy(self):
        from pdist.engine.backend import to_numpy
        return to_numpy(self.data)

    def item(self):
        from pdist.engine.backend import guard_host_read, is_device_array
        if is_device_array(self.data):
            guard_host_read()                # a device read: under the deadline (pdist.comm.gpu_sync)
        return self.data.item()

    def detach(self):
        return Tensor._make(self.data, False)

    # --- hooks --------------------------------------------------------------
    def register_hook(self, fn):
        """fn(grad) -> grad or None, run when dL/d(self) is complete."""
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(fn)
        return _Handle(self._hooks, fn)

    def register_post_accumulate_grad_hook(self, fn):
        """fn(tensor), run after this leaf's .grad got its last contribution."""
        if self._ctx is not None:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaf tensors")
        if self._post_acc_hooks is None:
            self._post_acc_hooks = []
        self._post_acc_hooks.append(fn)
        return _Handle(self._post_acc_hooks, fn)

    # --- backward -------------------------------------------------------------
    def backward(self, grad=None, defer_weights=False, inputs=()):
        """Accumulate d(self)/d(leaf) * grad into every leaf's .grad.

        ``defer_weights=True`` runs only B, the gradients of the activations and of the
        leaves in ``inputs`` (dL/dx = dL/dy W^T), and returns a ``WeightGradients`` whose
        ``run()`` is W, the weight gradients (dL/dW = x^T dL/dy) of every other leaf, and
        whose ``nbytes`` is the memory held until then. B then W equals the whole backward
        bit for bit (Qi et al., 2024; pdist/engine/split_backward.py)."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(did you build it under no_grad, or from tensors without requires_grad?)")
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a scalar, got shape {self.shape}")
            grad = xp.ones_like(self.data)
        elif isinstance(grad, Tensor):
            grad = grad.data
        if defer_weights:
            return run_backward_input(self, grad, inputs)
        if inputs:
            raise ValueError("backward(inputs=...) names the leaves B computes: it needs defer_weights=True")
        run_backward(self, grad)


def zero_grads(tensors, set_to_none=True):
    """End gradient accumulation: ``.grad = None`` (PyTorch's default), or zero the
    existing arrays in place (keeps views, e.g. DDP's bucket views, intact)."""
    for t in tensors:
        if set_to_none or t.transient_grad:    # a master weight's fp32 gradient: always dropped
            t.grad = None
        elif t.grad is not None:
            t.grad[...] = 0


class _Handle:
    def __init__(self, lst, fn):
        self._lst, self._fn = lst, fn

    def remove(self):
        if self._fn in self._lst:
            self._lst.remove(self._fn)


class Function:
    """One differentiable operation y = f(x_1, ..., x_k).

    Subclasses implement ``forward(self, *arrays, **kw) -> array`` and
    ``backward(self, grad_y) -> (grad_x_1, ..., grad_x_k)`` (``None`` for inputs
    without gradient). ``Op.apply(*inputs, **kw)`` runs forward on the arrays of
    tensor inputs and, when grad mode is on and an input requires grad, records
    the node: ``self.parents`` (the input tensors, ``None`` for non-tensors) and
    ``self.needs_input_grad``.

    A split backward (``Tensor.backward(defer_weights=True)``) calls a ``split_backward``
    Function twice, asking first for its input gradients, then for its weight gradients.
    """

    parents = ()
    needs_input_grad = ()
    fresh_grads = False  # True: backward's gradients are new arrays, distinct, held nowhere else
    split_backward = False  # True: backward honours needs_input_grad and may run twice (B, then W)
    param_view = False      # True: applied to weights only, its output is a weight (Cast, Reshape, Permute)

    @classmethod
    def apply(cls, *inputs, **kw):
        fn = _swapped.get(cls, cls)() if _swapped else cls()
        arrays = [x.data if isinstance(x, Tensor) else x for x in inputs]
        out = fn.forward(*arrays, **kw)
        requires = _grad_enabled[0] and any(isinstance(x, Tensor) and x.requires_grad for x in inputs)
        t = Tensor._make(out, requires)
        if requires:
            fn.parents = tuple(x if isinstance(x, Tensor) else None for x in inputs)
            fn.needs_input_grad = tuple(isinstance(x, Tensor) and x.requires_grad for x in inputs)
            t._ctx = fn
        return t

    def forward(self, *arrays, **kw):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, grad):  # pragma: no cover - abstract
        raise NotImplementedError
