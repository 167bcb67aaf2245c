"""Modules with PyTorch's names, and GPT-2.

``Module`` keeps its parameters and children in insertion order, so
``named_parameters()`` and ``state_dict()`` use dotted names
(``transformer.h.0.attn.c_attn.weight``). Linear weights are stored ``(in, out)``
and applied as ``y = x @ W + b``: Hugging Face GPT-2's ``Conv1D`` layout, so a
GPT-2 ``model.safetensors`` loads without transposes.

Initialisation never depends on the parallel layout: every GPT parameter is
drawn (in float64, on the host) from its own generator seeded by
``(seed, crc32(name))`` -- see ``gpt_init`` -- so a tensor-parallel rank can draw
the full "master" weight and keep its slice, and a pipeline stage can draw only
the layers it holds, and both start from exactly the single-process weights.
"""
import math
from collections import OrderedDict

import numpy as np

from pdist.engine import functional, precision
from pdist.engine.autograd import Tensor, zero_grads
from pdist.engine.backend import asarray, default_dtype, to_numpy

F = functional
_default_rng = [np.random.default_rng(0)]


def manual_seed(seed):
    """Seed the generator that initialises plain modules (Linear, Embedding) built without rng."""
    _default_rng[0] = np.random.default_rng(seed)


class Parameter(Tensor):
    """A leaf tensor that a Module owns and an optimizer updates."""

    def __init__(self, data, dtype=None, name=None):
        super().__init__(data, requires_grad=True, dtype=dtype, name=name)


class Module:
    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_pre_hooks", [])
        object.__setattr__(self, "_post_hooks", [])
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._params[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args, **kw):
        for h in self._pre_hooks:
            r = h(self, args)
            if r is not None:
                args = r if isinstance(r, tuple) else (r,)
        out = self.forward(*args, **kw)
        for h in self._post_hooks:
            r = h(self, args, out)
            if r is not None:
                out = r
        return out

    def forward(self, *args, **kw):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def register_forward_pre_hook(self, fn):
        """fn(module, args) -> new args or None, before forward."""
        self._pre_hooks.append(fn)
        return fn

    def register_forward_hook(self, fn):
        """fn(module, args, output) -> new output or None, after forward."""
        self._post_hooks.append(fn)
        return fn

    def named_modules(self, prefix=""):
        """(dotted name, module) for self and every descendant, depth first, in registration order."""
        stack = [(prefix, self)]
        while stack:  # iterative: a deep model walked every step (zero_grad) costs no generator chain
            name, m = stack.pop()
            yield name, m
            stack.extend(reversed([(f"{name}.{k}" if name else k, c) for k, c in m._modules.items()]))

    def modules(self):
        return [m for _, m in self.named_modules()]

    def children(self):
        return list(self._modules.values())

    def named_parameters(self, prefix=""):
        seen = set()
        for mname, m in self.named_modules(prefix):
            for pname, p in m._params.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mname}.{pname}" if mname else pname), p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self, set_to_none=True):
        zero_grads(self.parameters(), set_to_none)

    def train(self, mode=True):
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self):
        """name -> NumPy array (a copy), in registration order."""
        return OrderedDict((n, np.array(to_numpy(p.data))) for n, p in self.named_parameters())

    def load_state_dict(self, state_dict, strict=True, ignore=()):
        """Copy arrays into the parameters (in place, cast to each parameter's dtype).
        Raises one error listing every missing key, unexpected key and shape mismatch."""
        params = dict(self.named_parameters())
        missing = [k for k in params if k not in state_dict]
        unexpected = [k for k in state_dict if k not in params and not any(s in k for s in ignore)]
        bad = [f"{k}: checkpoint {tuple(np.shape(state_dict[k]))} vs model {params[k].shape}"
               for k in params if k in state_dict and tuple(np.shape(state_dict[k])) != params[k].shape]
        problems = []
        if bad:
            problems.append("shape mismatch: " + "; ".join(bad))
        if strict and missing:
            problems.append(f"missing keys: {missing}")
        if strict and unexpected:
            problems.append(f"unexpected keys: {unexpected}")
        if problems:
            raise KeyError(f"load_state_dict into {type(self).__name__} failed -- " + " | ".join(problems)
                           + " (use strict=False to load a subset)")
        for k, p in params.items():
            if k in state_dict:
                p.data[...] = asarray(state_dict[k], dtype=p.dtype)

    def num_parameters(self):
        return sum(p.size for p in self.parameters())


def _cast(a, dtype):
    return asarray(np.asarray(a, dtype=dtype or default_dtype()))


class Linear(Module):
    """y = x W + b with W (in, out) (``layout="in_out"``: GPT-2's Conv1D), or y = x W^T + b
    with W (out, in) (``layout="out_in"``: torch.nn.Linear's, HF Llama's). Default init as
    PyTorch: U(-1/sqrt(in), 1/sqrt(in))."""

    def __init__(self, in_features, out_features, bias=True, rng=None, dtype=None, layout="in_out"):
        super().__init__()
        rng = rng or _default_rng[0]
        self.in_features, self.out_features, self.layout = in_features, out_features, F.check_weight_layout(layout)
        k = 1.0 / math.sqrt(in_features)
        shape = (out_features, in_features) if layout == "out_in" else (in_features, out_features)
        self.weight = Parameter(_cast(rng.uniform(-k, k, shape), dtype))
        self.bias = Parameter(_cast(rng.uniform(-k, k, (out_features,)), dtype)) if bias else None

    def forward(self, x):
        return precision.linear(x, self.weight, self.bias, self.layout)   # F.linear, or mixed precision's


class Embedding(Module):
    """y = W[idx], W (num_embeddings, dim), init N(0, 1) like PyTorch."""

    def __init__(self, num_embeddings, embedding_dim, rng=None, dtype=None):
        super().__init__()
        rng = rng or _default_rng[0]
        self.weight = Parameter(_cast(rng.standard_normal((num_embeddings, embedding_dim)), dtype))

    def forward(self, idx):
        return precision.embedding(idx, self.weight)


class LayerNorm(Module):
    def __init__(self, dim, eps=1e-5, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(_cast(np.ones(dim), dtype))
        self.bias = Parameter(_cast(np.zeros(dim), dtype))

    def forward(self, x):
        return F.layer_norm(x, precision.weight(self.weight), precision.weight(self.bias), self.eps)


class RMSNorm(Module):
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis (Llama's; weight init 1)."""

    def __init__(self, dim, eps=1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(_cast(np.ones(dim), dtype))

    def forward(self, x):
        return F.rms_norm(x, precision.weight(self.weight), self.eps)


class ReLU(Module):
    def forward(self, x):
        return x.relu()


class GELU(Module):
    def forward(self, x):
        return F.gelu(x)


class Dropout(Module):
    def __init__(self, p=0.0, seed=0):
        super().__init__()
        self.p, self.rng = p, (np.random.default_rng(seed) if p > 0 else None)   # host masks

    def forward(self, x):
        return F.dropout(x, self.p, self.training, self.rng)


class ModuleList(Module):
    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, m):
        setattr(self, str(len(self._modules)), m)

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class Sequential(ModuleList):
    """y = f_k(... f_1(x)); its children are named 0, 1, ... like PyTorch's."""

    def __init__(self, *modules):
        super().__init__(modules)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


def cross_entropy(logits, targets, ignore_index=None):
    return F.cross_entropy(logits, targets, ignore_index)


def mse_loss(pred, target):
    return F.mse_loss(pred, target)


__all__ = ["Module", "Parameter", "Linear", "Embedding", "LayerNorm", "RMSNorm", "ReLU", "GELU", "Dropout",
           "ModuleList", "Sequential", "cross_entropy", "mse_loss", "functional", "manual_seed"]
