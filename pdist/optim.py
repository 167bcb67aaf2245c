"""Optimizers with PyTorch's semantics, updating parameters in place.

SGD (momentum mu, weight decay lambda, PyTorch's convention, no dampening):
    g <- g + lambda p;   b <- mu b + g;   p <- p - lr b

AdamW (Loshchilov & Hutter, 2019; PyTorch's torch.optim.AdamW):
    p <- p (1 - lr lambda)                          (decoupled weight decay)
    m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2
    p <- p - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

Each keeps two float32/64 state arrays the size of its parameters (m and v),
which is what ZeRO shards. ``state_dict()`` returns NumPy arrays.
"""
import math

import numpy as np

from pdist.engine.autograd import zero_grads
from pdist.engine.backend import is_device_array, to_numpy, xp
from pdist.errors import NonFiniteError


class Optimizer:
    def __init__(self, params, defaults):
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        self.param_groups = []
        for g in params:
            group = dict(defaults)
            group.update(g)
            group["params"] = list(g["params"])
            self.param_groups.append(group)
        self.state = {}  # id(param) -> dict of arrays

    def parameters(self):
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none=True):
        zero_grads(self.parameters(), set_to_none)

    def state_bytes(self):
        """Bytes of optimizer state arrays held by this process."""
        return sum(v.nbytes for s in self.state.values() for v in s.values() if hasattr(v, "nbytes"))

    def state_dict(self):
        """{"state": {index: {name: ndarray or number}}, "param_groups": [hyper-parameters]}"""
        index = {id(p): i for i, p in enumerate(self.parameters())}
        state = {index[k]: {n: (np.array(to_numpy(v)) if hasattr(v, "shape") else v) for n, v in s.items()}
                 for k, s in self.state.items() if k in index}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd):
        params = self.parameters()
        if len(sd["param_groups"]) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(sd['param_groups'])} param groups, "
                             f"this optimizer has {len(self.param_groups)}")
        for g, h in zip(self.param_groups, sd["param_groups"]):
            g.update(h)
        self.state = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            # copies (like PyTorch): the optimizer must not share arrays with the caller's dict
            self.state[id(p)] = {n: (xp.array(v, dtype=p.dtype, copy=True) if hasattr(v, "shape") else v)
                                 for n, v in s.items()}


class SGD(Optimizer):
    def __init__(self, params, lr=1e-2, momentum=0.0, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def step(self):
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if wd == 0 else p.grad + wd * p.data
                if mu:
                    s = self.state.setdefault(id(p), {})
                    if "momentum_buffer" not in s:
                        s["momentum_buffer"] = g.copy()
                    else:
                        s["momentum_buffer"] *= mu
                        s["momentum_buffer"] += g
                    g = s["momentum_buffer"]
                p.data -= lr * g


class AdamW(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"AdamW: invalid lr={lr}, betas={betas} or eps={eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state.get(id(p))
                if s is None:
                    s = self.state[id(p)] = {"step": 0, "exp_avg": xp.zeros_like(p.data),
                                             "exp_avg_sq": xp.zeros_like(p.data)}
                adamw_update(p.data, p.grad, s, lr, b1, b2, eps, wd)


BLOCK = 1 << 16  # elements per cache block of the host update (256 KiB of float32 per array)


def adamw_update(p, g, s, lr, b1, b2, eps, wd):
    """One AdamW step on arrays, in place (also used by ZeRO on its shards).

    13 elementwise passes with one temporary, the bias corrections and lr folded into the
    denominator: p -= m / ((sqrt(v) / sqrt(1 - b2^t) + eps) (1 - b1^t) / lr). On the host
    the passes run over blocks of ``BLOCK`` elements, so that p, g, m, v and the
    temporary stay in cache between passes: memory is read and written about once per
    step instead of 13 times (a 12.8 M-parameter update: 76 -> 42 ms here,
    docs/performance.md). On a device each pass is one kernel over the whole array."""
    s["step"] += 1
    t = s["step"]
    m, v = s["exp_avg"], s["exp_avg_sq"]
    step_size = lr / (1.0 - b1 ** t)
    c = (1.0 / (math.sqrt(1.0 - b2 ** t) * step_size), eps / step_size) if lr else None
    n = p.size
    if is_device_array(p) or n <= BLOCK or not all(a.flags.c_contiguous for a in (p, g, m, v)):
        _adamw_block(p, g, m, v, lr, b1, b2, wd, c, xp.empty_like(p))
        return
    pf, gf, mf, vf = p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1)  # views
    tmp = xp.empty(BLOCK, dtype=p.dtype)
    for lo in range(0, n, BLOCK):
        hi = min(n, lo + BLOCK)
        _adamw_block(pf[lo:hi], gf[lo:hi], mf[lo:hi], vf[lo:hi], lr, b1, b2, wd, c, tmp[:hi - lo])


def _adamw_block(p, g, m, v, lr, b1, b2, wd, c, tmp):
    """The update on one block, in place; ``tmp`` is scratch of p's shape; ``c`` = (scale,
    offset) of the folded denominator, None when lr = 0 (moments only)."""
    if wd:
        p *= 1.0 - lr * wd
    xp.multiply(g, 1.0 - b1, out=tmp)  # (1 - b1) g
    m *= b1
    m += tmp
    xp.multiply(g, g, out=tmp)
    tmp *= 1.0 - b2  # (1 - b2) g^2
    v *= b2
    v += tmp
    if c is None:
        return
    denom = xp.sqrt(v, out=tmp)
    denom *= c[0]
    denom += c[1]  # (sqrt(v_hat) + eps) / step_size
    p -= xp.divide(m, denom, out=tmp)  # lr m_hat / (sqrt(v_hat) + eps)


def _local_norm_reduction(grads, norm_type):
    """The local part of a gradient norm, as one device scalar built with one stacked
    reduction: sum |g|^p over all grads (finite p), or max |g| (p = inf)."""
    if norm_type == math.inf:
        parts = [xp.abs(g).max() for g in grads if g.size]  # one 0-d array per grad, no sync
        return xp.stack(parts).max() if parts else 0.0
    if norm_type == 2.0:
        parts = [xp.vdot(g.ravel(), g.ravel()) for g in grads]  # sum g^2 per grad
    else:
        parts = [(xp.abs(g) ** norm_type).sum() for g in grads]  # sum |g|^p per grad
    return xp.stack(parts).sum() if parts else 0.0


def _param_label(p, i):
    return p.name if getattr(p, "name", None) else f"params[{i}]"


def clip_grad_norm_(params, max_norm, norm_type=2.0, error_if_nonfinite=False, norm_fn=None):
    """Scale all gradients by one factor so that their global norm is at most
    ``max_norm``; returns the total norm before clipping (a float).

    PyTorch's semantics (torch.nn.utils.clip_grad_norm_): the total norm is the
    ``norm_type``-norm of all gradients taken as one vector (``math.inf``: the
    largest ``|g|``); every gradient is multiplied in place by
    ``min(1, max_norm / (total + 1e-6))``. So a non-finite total, without
    ``error_if_nonfinite``, makes the gradients NaN (inf total: factor 0, and
    ``inf * 0`` is NaN) -- exactly what PyTorch does.

    ``error_if_nonfinite=True``: a NaN or infinite total norm raises
    ``pdist.errors.NonFiniteError`` naming the parameters whose gradients are
    non-finite (``p.name`` when set, else ``params[i]``) and leaves every
    gradient untouched. PyTorch raises ``RuntimeError`` here; ``NonFiniteError``
    subclasses ``FloatingPointError``, so catch that (or ``NonFiniteError``).

    ``norm_fn(local) -> global`` lets a sharded strategy combine the local part
    across ranks: ``local`` is the sum of ``|g|^p`` over this rank's gradients
    (the sum of squares for the default L2 norm; combine with a SUM) or, for
    ``norm_type=inf``, the largest ``|g|`` (combine with a MAX).

    Cost: one stacked reduction on the device and one conversion to float (one
    sync), not one per parameter."""
    from pdist.engine.autograd import Tensor
    if isinstance(params, Tensor):
        params = [params]
    params = list(params)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    grads = [p.grad for p in params if p.grad is not None]
    local = float(to_numpy(_local_norm_reduction(grads, norm_type)))  # the one device sync, explicit
    total_red = norm_fn(local) if norm_fn is not None else local
    total_red = float(to_numpy(total_red))  # norm_fn may hand back a device scalar
    total = total_red if norm_type == math.inf else total_red ** (1.0 / norm_type)
    if not math.isfinite(total):
        if error_if_nonfinite:
            names = nonfinite_report([(_param_label(p, i), p.grad) for i, p in enumerate(params)])
            where = (", ".join(names) if names else
                     "no local gradient is non-finite (the norm overflowed, or another rank's is)")
            raise NonFiniteError(
                f"clip_grad_norm_: the total {norm_type:g}-norm of the gradients is {total} "
                f"(non-finite gradients: {where}); no gradient was changed. "
                "Pass error_if_nonfinite=False to clip anyway (PyTorch's behaviour: the "
                "gradients become NaN).")
    scale = max_norm / (total + 1e-6)
    if math.isnan(scale) or scale < 1.0:  # torch.clamp(coef, max=1.0) keeps NaN
        with np.errstate(invalid="ignore"):  # inf * 0 -> NaN is the documented result
            for g in grads:
                g *= scale
    return total


def nonfinite_report(named_grads, loss=None):
    """The names of the non-finite (NaN or +-inf) gradients, plus ``"loss"`` when
    ``loss`` is given and non-finite; ``[]`` when all are finite.

    ``named_grads``: ``(name, grad)`` pairs or a ``{name: grad}`` dict; a grad is
    an array, a ``Tensor`` (its ``.data``) or ``None`` (skipped). ``loss``: a
    number, an array or a ``Tensor``.

    Cost: one ``isfinite().all()`` per gradient, stacked into one array and read
    with one sync; only when something is non-finite is that small array read
    back to find the names (a second sync)."""
    from pdist.engine.autograd import Tensor
    items = named_grads.items() if hasattr(named_grads, "items") else named_grads
    names, checks = [], []
    for name, g in items:
        if g is None:
            continue
        if isinstance(g, Tensor):
            g = g.data
        names.append(str(name))
        checks.append(xp.isfinite(g).all())  # 0-d bool on the device, no sync
    bad_loss = False
    if loss is not None:
        if isinstance(loss, Tensor):
            loss = loss.data
        if hasattr(loss, "shape"):
            names.append("loss")
            checks.append(xp.isfinite(loss).all())
        else:
            bad_loss = not math.isfinite(float(loss))
    bad = []
    if checks:
        flags = xp.stack(checks)  # (n,) bool
        if not bool(to_numpy(flags.all())):  # the one sync when all is finite (explicit copy)
            bad = [n for n, ok in zip(names, to_numpy(flags)) if not ok]
    if bad_loss:
        bad.append("loss")
    return bad
