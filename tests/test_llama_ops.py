"""The ops a Llama-family model adds to the engine, each against finite differences (float64)
and a plain reference: Linear's (out, in) layout, RMSNorm, SwiGLU, rotary position
embeddings, and grouped-query attention in the one fused causal attention."""
import numpy as np
import pytest

from pdist import Tensor, nn
from pdist.engine import functional as F
from pdist.engine import precision

from fdcheck import grads_match


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# --- Linear: W stored (in, out) or (out, in) ----------------------------------------------
@pytest.mark.parametrize("xshape,bias", [((4, 3), True), ((2, 5, 3), True), ((2, 5, 3), False)])
def test_linear_out_in(xshape, bias):
    arrays = [rnd(*xshape, seed=1), rnd(4, 3, seed=2)] + ([rnd(4, seed=3)] if bias else [])
    grads_match(lambda x, w, *b: F.linear(x, w, *b, layout="out_in"), arrays)
    # the same numbers as the (in, out) layout with W^T stored
    x, w = arrays[0], arrays[1]
    got, want = [], []
    for layout, wl in (("out_in", w), ("in_out", np.ascontiguousarray(w.T))):
        tx, tw = Tensor(x, requires_grad=True), Tensor(wl, requires_grad=True)
        y = F.linear(tx, tw, *(Tensor(b) for b in arrays[2:]), layout=layout)
        y.backward(rnd(*y.shape, seed=4))
        (got if layout == "out_in" else want).append((y.data, tx.grad, tw.grad))
    np.testing.assert_allclose(got[0][0], want[0][0], rtol=1e-14)
    np.testing.assert_allclose(got[0][1], want[0][1], rtol=1e-14)
    np.testing.assert_allclose(got[0][2], want[0][2].T, rtol=1e-14)


def test_linear_layout_checks_and_module():
    with pytest.raises(ValueError, match=r"layout 'out_in': in_features=2"):
        F.linear(Tensor(np.ones((2, 3))), Tensor(np.ones((4, 2))), layout="out_in")
    with pytest.raises(ValueError, match="linear layout must be one of"):
        F.linear(Tensor(np.ones((2, 3))), Tensor(np.ones((3, 2))), layout="oi")
    with pytest.raises(ValueError, match="linear layout must be one of"):
        nn.Linear(3, 4, layout="io")
    m = nn.Linear(3, 4, bias=False, rng=np.random.default_rng(0), dtype="float64", layout="out_in")
    assert m.weight.shape == (4, 3) and m.layout == "out_in" and m.bias is None
    x = rnd(2, 3, seed=5)
    np.testing.assert_allclose(m(Tensor(x)).data, x @ m.weight.data.T, rtol=1e-14)
    assert nn.Linear(3, 4, rng=np.random.default_rng(0)).weight.shape == (3, 4)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_low_precision_linear_out_in_rounds_as_in_out(low):
    """LowLinear in (out, in) equals LowLinear in (in, out) on W^T bit for bit: round(X),
    upcast W, dW = round(G^T round(X)), db = round(sum G)."""
    dt = precision.low_dtype(low)
    x, w, b, g = rnd(2, 5, 3, seed=6), rnd(4, 3, seed=7).astype(dt), rnd(4, seed=8).astype(dt), rnd(2, 5, 4, seed=9)
    out = {}
    for layout, wl in (("out_in", w), ("in_out", np.ascontiguousarray(w.T))):
        tx, tw, tb = Tensor(x, requires_grad=True), Tensor(wl, requires_grad=True), Tensor(b, requires_grad=True)
        y = precision.linear(tx, tw, tb, layout=layout)
        y.backward(g)
        out[layout] = (y.data, tx.grad, tw.grad if layout == "out_in" else tw.grad.T, tb.grad)
    for a, c in zip(out["out_in"], out["in_out"]):
        assert a.dtype == c.dtype
        np.testing.assert_array_equal(a.astype(np.float64), c.astype(np.float64))
    assert out["out_in"][2].dtype == dt and out["out_in"][1].dtype == np.float64
    xr = x.astype(dt).astype(np.float64)
    np.testing.assert_array_equal(out["out_in"][0], xr @ w.astype(np.float64).T + b.astype(np.float64))
