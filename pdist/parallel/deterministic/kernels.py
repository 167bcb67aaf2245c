"""The deterministic mode's kernels: what its compute runs in place of the engine's ops.

    with exact_kernels():           # the mode's compute (a granule loop, a batched pass, a pipeline)
        ...                         # BLAS on one thread; every op below swapped for its twin here

Two facts make a granule's gradient d_j the same bits on every layout (policy.py):

* On one thread a GEMM's bits depend only on its shape and data. OpenBLAS cuts a GEMM's rows
  or columns among its threads, and under some kernels (its Haswell sgemm: AMD EPYC without
  AVX-512) an output element's bits depend on the block it falls in, so 2 threads give other
  bits than 1 (tests/test_deterministic.py, test_blas_bits_at_a_fixed_shape). So BLAS runs on
  one thread, and an embedding's gradient is added one token at a time in token order
  (``backend.scatter_add(exact_rows=True)``), never a one-hot GEMM over the V/t rows a
  vocabulary-parallel rank holds.
* Inside ``granules.batched(G)`` a rank's granules run in one pass, stacked on the leading
  axis (granules.py): every GEMM over batch rows is one GEMM per granule, and every sum
  over batch rows that makes a parameter's gradient is one sum per granule, a stack
  (G, *shape) that the backward walk keeps as the leaf's ``.grad``.

The engine's ops hold their algorithm only; each twin here is a subclass that overrides
the one step it changes (``autograd.substitute`` runs it in the op's place): Linear's row
folding and bias sum (``_rows``, ``_sum_rows``), the norms' weight sums (in ``token_blocks``
blocks of T too: blocks.py), the embeddings' scatter-adds, the losses' means (one per
granule), and the gradient of an operand broadcast over the batch (positions), of a
reshaped or transposed weight (the tied head). Outside ``batched`` each twin computes what
its op does, with the exact scatter.
"""
import contextlib
import math

from pdist.engine.autograd import substitute
from pdist.engine.backend import is_gpu, xp
from pdist.engine.functional import CrossEntropy, Embedding, Linear
from pdist.engine.norms import LayerNorm, RMSNorm
from pdist.engine.ops import Add, unbroadcast
from pdist.engine.precision import LowEmbedding, LowLinear
from pdist.engine.reductions import ones
from pdist.engine.shape_ops import Permute, Reshape
from pdist.parallel.deterministic import granules
from pdist.parallel.deterministic.blocks import blocked_row_sums, token_col_sums
from pdist.parallel.tensor.layers import _VocabParallelCrossEntropy, _VocabParallelEmbedding

_blas = {}


class GranuleRows:
    """Linear's GEMMs and bias sum, one per granule: rows (G, N/G, K) in the batched pass."""

    def _rows(self, a):
        return granules.per_granule(super()._rows(a))

    def _sum_rows(self, a):
        return granules.col_sums(a, ones)                                  # (K,); batched: (G, K)


class GranuleLinear(GranuleRows, Linear):
    pass


class GranuleLowLinear(GranuleRows, LowLinear):
    pass


class TokenSums:
    """A norm's weight gradients summed per granule, in ``token_blocks`` blocks of T (blocks.py)."""

    def forward(self, *args, token_blocks=1, **kw):
        self.token_blocks = token_blocks
        return super().forward(*args, **kw)

    def _sum_rows(self, a2):
        return token_col_sums(a2, self.shape, self.token_blocks)         # (C,); batched: (G, C)


class GranuleLayerNorm(TokenSums, LayerNorm):
    pass


class GranuleRMSNorm(TokenSums, RMSNorm):
    pass


class GranuleEmbedding(Embedding):
    def backward(self, g):
        return granules.embedding_grad(self.wshape, g.dtype, self.idx, g), None       # batched: (G, V, C)


class GranuleLowEmbedding(LowEmbedding):
    def backward(self, g):
        gw = granules.embedding_grad(self.wshape, g.dtype, self.idx, g)
        return (gw if self.keep else gw.astype(self.wdtype)), None


class GranuleVocabEmbedding(_VocabParallelEmbedding):
    def backward(self, g):
        g = g * self.keep[..., None]
        return granules.embedding_grad(self.wshape, g.dtype, self.local, g), None, None   # batched: (G, V/t, C)


def _granule_means(nll, count, dtype):
    """The G granules' mean losses (G,): each granule's rows summed, over its ``count`` rows."""
    return xp.asarray(nll.reshape(granules.count(), -1).sum(axis=1) / count, dtype=dtype)


def _scale_per_granule(d, g, count):
    """dL/dz of granule j's rows scaled by g_j / count (g: the (G,) seeds of the batched pass)."""
    d.reshape(g.shape[0], -1, d.shape[-1])[...] *= (g / count)[:, None, None]


class GranuleCrossEntropy(CrossEntropy):
    def _mean(self, nll, dtype):
        G = granules.count()
        if G is None:
            return super()._mean(nll, dtype)
        if self.keep is not None:
            raise ValueError("cross_entropy: ignore_index in the deterministic mode's batched pass (granules "
                             "with other token counts); use Deterministic(batched=False)")
        self.count = nll.shape[0] // G
        return _granule_means(nll, self.count, dtype)

    def _scale(self, d, g):
        _scale_per_granule(d, g, self.count) if g.ndim else super()._scale(d, g)


class GranuleVocabCrossEntropy(_VocabParallelCrossEntropy):
    """The vocab-parallel loss per granule, and with ``blocks`` > 1 the sum of exponentials over
    this rank's vocabulary as that many blocks, a tree (blocks.py)."""

    def forward(self, logits, targets, group, vocab_start, blocks=1):
        self.blocks = blocks
        return super().forward(logits, targets, group, vocab_start)

    def _exp_sums(self, e):
        return super()._exp_sums(e) if self.blocks == 1 else blocked_row_sums(e, self.blocks)

    def _mean(self, nll, dtype):
        G = granules.count()
        return super()._mean(nll, dtype) if G is None else _granule_means(nll, nll.shape[0] // G, dtype)

    def _scale(self, d, g):
        _scale_per_granule(d, g, d.shape[0] // g.shape[0]) if g.ndim else super()._scale(d, g)


class GranuleAdd(Add):
    """An operand broadcast over the batch axis (GPT-2's positions) gets a per-granule stack."""

    def backward(self, g):
        return _unbroadcast_add(g, self.sa), _unbroadcast_add(g, self.sb)


def _unbroadcast_add(g, shape):
    if granules.count() is not None:
        stack = granules.unbroadcast_rows(g, shape)
        if stack is not None:
            return stack
    return unbroadcast(g, shape)


class GranuleReshape(Reshape):
    def backward(self, g):
        G = granules.count()
        if G is not None and g.size == G * math.prod(self.shape) != math.prod(self.shape):   # a (G, ...) stack
            return g.reshape((G,) + tuple(self.shape))
        return super().backward(g)


class GranulePermute(Permute):
    def backward(self, g):
        if g.ndim == len(self.inv) + 1 and granules.count() is not None:   # a weight's (G, ...) stack
            return g.transpose((0,) + tuple(i + 1 for i in self.inv))
        return super().backward(g)


KERNELS = {Linear: GranuleLinear, LowLinear: GranuleLowLinear, LayerNorm: GranuleLayerNorm,
           RMSNorm: GranuleRMSNorm, Embedding: GranuleEmbedding, LowEmbedding: GranuleLowEmbedding,
           _VocabParallelEmbedding: GranuleVocabEmbedding, CrossEntropy: GranuleCrossEntropy,
           _VocabParallelCrossEntropy: GranuleVocabCrossEntropy, Add: GranuleAdd, Reshape: GranuleReshape,
           Permute: GranulePermute}


@contextlib.contextmanager
def exact_kernels():
    """The mode's compute runs inside this (module docstring): BLAS on one thread, the exact
    scatter, and every op of ``KERNELS`` swapped for its twin."""
    with granules.exact_rows(), _one_blas_thread(), substitute(KERNELS):
        yield


def _one_blas_thread():
    if is_gpu():                                # pragma: no cover - GPU: cuBLAS, no host threads
        return contextlib.nullcontext()
    if "ctl" not in _blas:
        from threadpoolctl import ThreadpoolController
        _blas["ctl"] = ThreadpoolController()    # scans the loaded libraries once (ms); a limit is ~8 us
    return _blas["ctl"].limit(limits=1, user_api="blas")


__all__ = ["exact_kernels", "KERNELS", "GranuleVocabCrossEntropy", "TokenSums"]
