"""The deterministic mode's batched pass: G granules in ONE forward and backward, with the
bits of G separate passes (pdist/parallel/deterministic/policy.py, docs/deterministic.md).

Inside ``batched(G)`` an activation's leading axis holds G granules of equal rows,
granule-major: rows [j B/G, (j+1) B/G) are granule j. Two kinds of op would see the
granules mixed, and each is cut back to the granule's own shape here:

* A GEMM whose result depends on how many rows surround it (OpenBLAS picks other kernels
  for other row counts): Linear's X W, dX = G W^T and dW = X^T G run as per-granule batched
  matmuls, (G, g T, K) @ (K, N). NumPy's matmul calls one gemm per slice of a stack, with
  the slice's shape, so slice j has the bits of the 2-D product of granule j alone
  (tests/test_deterministic.py checks this BLAS property).
* A reduction over batch rows that makes a parameter's gradient (Linear and row biases, the
  norms' gains, the embeddings' scatter-adds, a broadcast add's sum): each returns a
  per-granule stack (G, *shape), d_j = dL_j/dw with the sums of granule j alone; the
  leaves' ``.grad`` hold the stacks (the graph adds a tied weight's two stacks in the
  loop's order), and the deterministic mode takes d_j = stack[j] as granule j's leaf.

Row-wise ops (elementwise, a row's softmax, LayerNorm's row statistics, attention per (b, head))
are the same per row whatever the rows around them, and run on the whole stack. Outside
``batched``, ``count()`` is None and every function here is the plain op (the loop path).
"""
import contextlib

from pdist.engine.backend import scatter_add, xp

_state = {"G": None, "exact": False}


@contextlib.contextmanager
def batched(G):
    """Ops inside see G granules stacked on the leading axis (module docstring)."""
    prev, _state["G"] = _state["G"], int(G)
    try:
        yield
    finally:
        _state["G"] = prev


@contextlib.contextmanager
def exact_rows():
    """The deterministic mode's compute (pdist/parallel/deterministic/policy.py, ``exact_kernels``): the
    embeddings' scatter-adds one value at a time in token order (``np.add.at``), never a
    one-hot GEMM or reduceat (backend.scatter_add says why)."""
    prev, _state["exact"] = _state["exact"], True
    try:
        yield
    finally:
        _state["exact"] = prev


def count():
    """The number of stacked granules of the running batched pass, or None (loop path)."""
    return _state["G"]


def stacks(g, rows=0):
    """True when ``g`` is a per-granule stack of a gradient with ``rows`` dims (G, *shape)."""
    G = _state["G"]
    return G is not None and g.ndim == rows + 1 and g.shape[0] == G


def per_granule(a2):
    """a2 (N, K), the rows of the stacked granules -> (G, N / G, K), or a2 outside ``batched``."""
    G = _state["G"]
    return a2 if G is None else a2.reshape(G, -1, a2.shape[-1])


def col_sums(a2, ones):
    """1^T a per granule: a2 (N, C) -> (C,), or (G, C) in ``batched`` (one gemv per granule)."""
    G = _state["G"]
    if G is None:
        return ones(a2.shape[0], a2.dtype) @ a2
    a3 = a2.reshape(G, -1, a2.shape[-1])                                                  # (G, n, C)
    return ones(a3.shape[1], a2.dtype) @ a3                                               # (G, C)


def unbroadcast_rows(g, shape):
    """The gradient of an operand of ``shape`` broadcast over the batch axis of g (B, ...):
    in ``batched``, per granule, (G, *shape), each the loop's ``g_j.sum(axis=0)``; else None."""
    G = _state["G"]
    if G is None or len(shape) != g.ndim - 1 or g.shape[0] % G or tuple(g.shape[1:]) != tuple(shape):
        return None
    return g.reshape((G, -1) + tuple(shape)).sum(axis=1)                                  # (G, *shape)


def embedding_grad(wshape, dtype, idx, g):
    """dW of y = W[idx]: the scatter-add of g (..., C) at idx, or per granule in ``batched``
    (G, *wshape): granule j's rows of idx (leading axis) or, for a stacked g (G, *idx.shape, C)
    (a broadcast lookup, the positions), g[j] at idx."""
    G, C = _state["G"], wshape[1]
    if G is None:
        gw = xp.zeros(wshape, dtype=dtype)
        scatter_add(gw, idx.reshape(-1), g.reshape(-1, C), _state["exact"])
        return gw
    gw = xp.zeros((G,) + tuple(wshape), dtype=dtype)                                      # (G, V, C)
    whole = g.ndim == idx.ndim + 2                                                        # g stacked
    idx_g = None if whole else idx.reshape(G, -1)
    g3 = g.reshape(G, -1, C)
    for j in range(G):
        scatter_add(gw[j], (idx if whole else idx_g[j]).reshape(-1), g3[j], True)
    return gw


__all__ = ["batched", "count", "stacks", "per_granule", "col_sums", "unbroadcast_rows", "embedding_grad"]
