"""What every causal language model here shares (GPT-2, Llama): the forward in the parts
a pipeline cuts, layout-independent init, meta init, the loss and sampling.

    x = embed(idx)                      # (B, T, C)   the first part
    for block in blocks: x = block(x)   # (B, T, C)   an nn.ModuleList, split over pipeline stages
    logits = head(x)                    # (B, T, V)   the last part
    loss = loss_fn(logits, targets)     # a CrossEntropyLoss module (tensor parallelism swaps it)

Init never depends on the parallel layout: parameter ``name`` is drawn in float64 from its
own generator, seeded by (seed, crc32(name)) (``param_rng``), as N(0, std^2) or a constant.
``init_rows(name, a, b)`` draws rows [a, b) of it as a stream (pdist.engine.meta.RowStream:
a Generator gives the same normals however many are asked at a time), so a meta model
(``device="meta"``) is filled piece by piece to the bit (``materialize``).

A model subclasses ``CausalLM``: builds its modules with the ``ZEROS`` placeholder
generator, calls ``init_parameters(device)``, and defines ``embed``, ``head``, ``blocks``,
``init_value(name)`` and ``init_stream(name)``.
"""
import zlib

import numpy as np

from pdist import nn
from pdist.engine import functional as F
from pdist.engine.autograd import Tensor, no_grad
from pdist.engine.backend import asarray, default_dtype, to_numpy, xp
from pdist.engine.meta import MetaArray, RowStream, materialize_whole
from pdist.models.moe import aux_loss


class ZerosRng:
    """Placeholder generator: the modules are filled by the model's init right after. Its zeros
    are a broadcast view of one element (no memory), so a meta model never allocates."""
    def uniform(self, lo, hi, shape):
        return np.broadcast_to(np.zeros((), default_dtype()), shape)

    def standard_normal(self, shape):
        return np.broadcast_to(np.zeros((), default_dtype()), shape)


ZEROS = ZerosRng()


def param_rng(seed, name):
    """The generator of parameter ``name``: seeded by (seed, crc32(name)), nothing else."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def normal_init(shape, name, seed, std):
    """N(0, std^2) of ``shape`` from ``param_rng(seed, name)``, float64."""
    return param_rng(seed, name).standard_normal(shape) * std


def init_stream(shape, name, seed, std=None, const=None):
    """``normal_init(shape, name, seed, std)`` (or the constant ``const``) as a row stream:
    rows [a, b) drawn in chunks, bit-identical to the whole array."""
    inner = tuple(shape[1:])
    if const is not None:
        return RowStream(shape, lambda: (lambda n: np.full((n,) + inner, float(const))))

    def restart():
        rng = param_rng(seed, name)
        return lambda n: rng.standard_normal((n,) + inner) * std
    return RowStream(shape, restart)


def check_device(device, model):
    if device not in (None, "meta"):
        raise ValueError(f"{model} device must be None or 'meta', got {device!r}")


class CrossEntropyLoss(nn.Module):
    """loss = mean_n -log softmax(z_n)[y_n] over every token (PyTorch's name)."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets)


class CausalLM(nn.Module):
    """A causal LM: ``forward(idx)`` -> logits, ``forward(idx, targets)`` -> (logits, loss).
    See the module docstring for what a subclass defines."""

    def parallel_plan(self):
        """How each layer is cut by the strategies: the config's plan (pdist/models/plan.py)."""
        return self.config.parallel_plan()

    def init_parameters(self, device=None):
        """Every parameter (registered so far) gets its init value, or meta data of its shape,
        and its name (``p.name``, the single-process name every piece refers to)."""
        check_device(device, type(self).__name__)
        dtype = self.config.dtype
        for name, p in self.named_parameters():
            p.data = (MetaArray(p.data.shape, dtype) if device == "meta"
                      else asarray(self.init_value(name), dtype=dtype))
            p.name = name
        self._streams = {}

    def init_rows(self, name, a, b):
        """Rows [a, b) of ``init_value(name)`` (float64), drawn as a stream."""
        if name not in self._streams:
            self._streams[name] = self.init_stream(name)
        return self._streams[name].rows(a, b)

    def materialize(self):
        """Fill every meta parameter with its whole init value (one process)."""
        materialize_whole(self.named_parameters(), self.init_rows)
        self._streams.clear()

    def tokens(self, idx):
        """idx as an integer array (B, T), T checked against block_size."""
        idx = idx.data if isinstance(idx, Tensor) else xp.asarray(idx)
        if idx.shape[-1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[-1]} exceeds block_size {self.config.block_size}")
        return idx

    def forward(self, idx, targets=None):
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits
        loss = self.loss_fn(logits, targets)
        aux = aux_loss(self) if getattr(self.config, "n_expert", 0) else None   # MoE: + the balancing loss
        return logits, loss if aux is None else loss + aux

    def generate(self, idx, n_new, temperature=1.0, seed=0):
        """Sample n_new tokens after idx (B, T) -> (B, T + n_new) NumPy ints."""
        rng = np.random.default_rng(seed)
        idx = np.array(idx)
        with no_grad():
            for _ in range(n_new):
                ctx = idx[:, -self.config.block_size:]
                z = to_numpy(self(xp.asarray(ctx)).data[:, -1, :]).astype(np.float64) / temperature
                p = np.exp(z - z.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                nxt = [rng.choice(p.shape[1], p=row) for row in p]
                idx = np.concatenate([idx, np.array(nxt)[:, None]], axis=1)
        return idx


__all__ = ["CausalLM", "CrossEntropyLoss", "ZEROS", "ZerosRng", "param_rng", "normal_init", "init_stream",
           "check_device"]
