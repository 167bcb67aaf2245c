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

from pdist.autograd import zero_grads
from pdist.backend import to_numpy, xp


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


def adamw_update(p, g, s, lr, b1, b2, eps, wd):
    """One AdamW step on arrays, in place (also used by ZeRO on its shards).
    Uses one temporary the size of p (no other allocations)."""
    s["step"] += 1
    t = s["step"]
    m, v = s["exp_avg"], s["exp_avg_sq"]
    if wd:
        p *= 1.0 - lr * wd
    tmp = xp.multiply(g, 1.0 - b1)  # (1 - b1) g
    m *= b1
    m += tmp
    xp.multiply(g, g, out=tmp)
    tmp *= 1.0 - b2  # (1 - b2) g^2
    v *= b2
    v += tmp
    bc1 = 1.0 - b1 ** t
    bc2_sqrt = math.sqrt(1.0 - b2 ** t)
    denom = xp.sqrt(v, out=tmp)
    denom /= bc2_sqrt
    denom += eps  # sqrt(v_hat) + eps
    step = xp.divide(m, denom, out=tmp)
    step *= lr / bc1  # lr m_hat / (sqrt(v_hat) + eps)
    p -= step


def clip_grad_norm_(params, max_norm, norm_fn=None):
    """Scale gradients in place so that their global L2 norm is at most max_norm;
    returns the norm before clipping. ``norm_fn(local_sq_sum) -> global_sq_sum``
    lets a sharded strategy all-reduce the squared norm across ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = sum(float((g * g).sum()) for g in grads)
    if norm_fn is not None:
        sq = norm_fn(sq)
    total = math.sqrt(sq)
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g *= scale
    return total
