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


# --- RMSNorm -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 5), (3, 1)])
def test_rms_norm(shape):
    C = shape[-1]
    x, w = rnd(*shape, seed=10), rnd(C, seed=11)
    grads_match(lambda x, w: F.rms_norm(x, w, 1e-5), [x, w], rtol=1e-5, atol=1e-7)
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(F.rms_norm(Tensor(x), Tensor(w), 1e-5).data, ref, rtol=1e-12, atol=1e-14)


def test_rms_norm_non_contiguous_float32_and_module():
    x = rnd(6, 4, seed=12).T  # (4, 6), a transposed view
    grads_match(lambda x, w: F.rms_norm(x, w), [x, rnd(6, seed=13)], rtol=1e-5, atol=1e-7)
    m = nn.RMSNorm(6, eps=1e-6, dtype="float32")
    assert m.weight.dtype == np.float32 and np.all(m.weight.data == 1)
    t = Tensor(x.astype(np.float32), requires_grad=True)
    y = m(t)
    y.backward(rnd(4, 6, seed=14).astype(np.float32))
    assert y.dtype == t.grad.dtype == m.weight.grad.dtype == np.float32
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y.data, ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_rms_norm_under_mixed_precision(low):
    """The weight comes in upcast (precision.weight), the norm runs in the compute dtype, and
    the weight's gradient is rounded to its own dtype once, as LayerNorm's."""
    m = nn.RMSNorm(5, dtype="float64")
    m.weight.data = m.weight.data + rnd(5, seed=15) * 0.3
    w64 = m.weight.data.copy()
    precision.cast_module(m, low)
    x, g = rnd(3, 5, seed=16), rnd(3, 5, seed=17)
    t = Tensor(x, requires_grad=True)
    y = m(t)
    y.backward(g)
    wl = w64.astype(precision.low_dtype(low)).astype(np.float64)
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    assert y.dtype == t.grad.dtype == np.float64 and m.weight.grad.dtype == precision.low_dtype(low)
    np.testing.assert_allclose(y.data, ref * wl, rtol=1e-13)
    np.testing.assert_array_equal(m.weight.grad, (g * ref).sum(0).astype(precision.low_dtype(low)))


# --- SwiGLU --------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (2, 3, 5)])
def test_swiglu(shape):
    a, b = rnd(*shape, seed=18) * 3, rnd(*shape, seed=19)
    grads_match(F.swiglu, [a, b])
    np.testing.assert_allclose(F.swiglu(Tensor(a), Tensor(b)).data, a / (1 + np.exp(-a)) * b, rtol=1e-14)
    big = np.array([-800.0, -40.0, 0.0, 40.0, 800.0])     # no overflow, silu's limits
    y = F.swiglu(Tensor(big), Tensor(np.ones(5))).data
    np.testing.assert_allclose(y, [0.0, -40.0 / (1 + np.exp(40.0)), 0.0, 40.0, 800.0], rtol=1e-14, atol=1e-300)
    with pytest.raises(ValueError, match=r"swiglu: gate \(2,\) and up \(3,\)"):
        F.swiglu(Tensor(np.ones(2)), Tensor(np.ones(3)))


def test_swiglu_float32_and_one_input_grad():
    a, b = rnd(4, 6, seed=20).astype(np.float32), rnd(4, 6, seed=21).astype(np.float32)
    ta = Tensor(a, requires_grad=True)
    y = F.swiglu(ta, Tensor(b))             # only the gate needs a gradient
    y.backward(np.ones_like(a))
    assert y.dtype == ta.grad.dtype == np.float32
    s = 1 / (1 + np.exp(-a.astype(np.float64)))
    np.testing.assert_allclose(ta.grad, b * s * (1 + a * (1 - s)), rtol=1e-5, atol=1e-6)


# --- rotary position embeddings -------------------------------------------------------------
def rope_reference(x, d, theta):
    """HF Llama's formula, written out: x * cos + rotate_half(x) * sin per head."""
    T = x.shape[-2]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    emb = np.concatenate([np.outer(np.arange(T), inv)] * 2, axis=-1)  # (T, d)
    x4 = x.reshape(*x.shape[:-1], -1, d)
    rot = np.concatenate([-x4[..., d // 2:], x4[..., :d // 2]], axis=-1)
    return (x4 * np.cos(emb)[:, None] + rot * np.sin(emb)[:, None]).reshape(x.shape)


@pytest.mark.parametrize("shape,d,theta", [((2, 5, 12), 4, 10000.0), ((1, 3, 6), 6, 500.0), ((4, 2), 2, 10.0)])
def test_rotary(shape, d, theta):
    x = rnd(*shape, seed=22)
    grads_match(lambda t: F.apply_rotary(t, d, theta), [x])
    np.testing.assert_allclose(F.apply_rotary(Tensor(x), d, theta).data, rope_reference(x, d, theta),
                               rtol=1e-13, atol=1e-15)


def test_rotary_is_relative_float32_and_checks():
    # q_t . k_u depends on t - u only: q at 2 and k at 5 give what q at 5 and k at 8 give
    d, rng = 8, np.random.default_rng(23)
    q, k = rng.standard_normal(d), rng.standard_normal(d)
    seq = np.zeros((1, 9, 2 * d))  # head 0 holds q, head 1 holds k
    seq[0, 2, :d], seq[0, 5, d:], seq[0, 5, :d], seq[0, 8, d:] = q, k, q, k
    r = F.apply_rotary(Tensor(seq), d, 100.0).data[0]
    np.testing.assert_allclose(r[2, :d] @ r[5, d:], r[5, :d] @ r[8, d:], rtol=1e-13)
    assert abs(r[2, :d] @ r[5, d:] - q @ k) > 1e-3  # and it does depend on the distance
    x32 = rnd(2, 4, 8, seed=24).astype(np.float32)
    y = F.apply_rotary(Tensor(x32), 4)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y.data, rope_reference(x32.astype(np.float64), 4, 10000.0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="head_dim 3 must be even"):
        F.apply_rotary(Tensor(np.ones((2, 6))), 3)


# --- grouped-query attention ---------------------------------------------------------------
def repeat_kv_attention(q, k, v, nh, nkv):
    """The reference from small ops: k, v repeated to n_head heads (HF's repeat_kv), then
    softmax(q k^T / sqrt(hs) + M) v per head."""
    B, T, C = q.shape
    hs, g = C // nh, nh // nkv
    qh = q.reshape(B, T, nh, hs).permute(0, 2, 1, 3)  # (B, nh, T, hs)
    kh, vh = (t.reshape(B, T, nkv, hs).permute(0, 2, 1, 3) for t in (k, v))
    rep = np.repeat(np.eye(nkv), g, axis=0)  # (nh, nkv): query head h reads kv head h // g
    kh, vh = (Tensor(rep[None, :, :, None, None]) * t.reshape(B, 1, nkv, T, hs) for t in (kh, vh))
    kh, vh = kh.sum(axis=2), vh.sum(axis=2)  # (B, nh, T, hs)
    att = F.scaled_causal_softmax(qh @ kh.transpose(-2, -1), 1.0 / np.sqrt(hs))
    return (att @ vh).permute(0, 2, 1, 3).reshape(B, T, C)


@pytest.mark.parametrize("B,T,nh,nkv,hs", [(2, 5, 4, 2, 3), (1, 6, 6, 1, 2), (2, 4, 3, 3, 2), (1, 1, 2, 1, 2)])
def test_grouped_query_attention(B, T, nh, nkv, hs):
    from pdist.engine.attention import causal_attention, causal_self_attention
    q, k, v = rnd(B, T, nh * hs, seed=30), rnd(B, T, nkv * hs, seed=31), rnd(B, T, nkv * hs, seed=32)
    grads_match(lambda q, k, v: causal_attention(q, k, v, nh, nkv), [q, k, v])
    g = rnd(B, T, nh * hs, seed=33)
    got = []
    for f in (lambda *t: causal_attention(*t, nh, nkv), lambda *t: repeat_kv_attention(*t, nh, nkv)):
        ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
        y = f(*ts)
        y.backward(g)
        got.append([y.data] + [t.grad for t in ts])
    for a, b in zip(*got):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    # the fused [Q | K | V] entry point: the same numbers, gradients in one array
    t = Tensor(np.concatenate([q, k, v], axis=-1), requires_grad=True)
    y = causal_self_attention(t, nh, nkv)
    y.backward(g)
    np.testing.assert_allclose(y.data, got[0][0], rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(t.grad, np.concatenate(got[0][1:], axis=-1), rtol=1e-14, atol=1e-15)


def test_grouped_query_attention_blocks_and_checks(monkeypatch):
    """Causal blocks and batch chunks with g = 3 query heads per kv head: the values and the
    gradients of one block (dk, dv sum the group's heads across the blocks)."""
    import pdist.engine.attention as A
    B, T, nh, nkv, hs = 3, 70, 6, 2, 4
    arrays = [rnd(B, T, nh * hs, seed=34), rnd(B, T, nkv * hs, seed=35), rnd(B, T, nkv * hs, seed=36)]
    g = rnd(B, T, nh * hs, seed=37)

    def run(qblock, chunk_bytes):
        monkeypatch.setattr(A, "QBLOCK", qblock)
        monkeypatch.setattr(A, "CHUNK_BYTES", chunk_bytes)
        ts = [Tensor(a, requires_grad=True) for a in arrays]
        y = A.causal_attention(*ts, nh, nkv)
        saved = sum(p.size for p in y._ctx.P)
        y.backward(g)
        return [y.data] + [t.grad for t in ts], saved

    one, s1 = run(T, 1 << 40)
    many, sb = run(16, 1)
    assert s1 == B * nh * T * T and sb == B * nh * A.saved_scores(T, 16)
    for a, b in zip(one, many):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)
    monkeypatch.setattr(A, "QBLOCK", 3)
    grads_match(lambda q, k, v: A.causal_attention(q, k, v, 4, 2),
                [rnd(1, 7, 8, seed=38), rnd(1, 7, 4, seed=39), rnd(1, 7, 4, seed=40)])
    with pytest.raises(ValueError, match="n_head 3 must be a multiple of n_kv_head 2"):
        A.causal_attention(*(Tensor(np.ones((1, 2, 6))) for _ in range(3)), 3, 2)
    with pytest.raises(ValueError, match=r"k \(1, 2, 6\), v \(1, 2, 6\) \(B, T, n_kv_head 1 x hs\)"):
        A.causal_attention(*(Tensor(np.ones((1, 2, 6))) for _ in range(3)), 2, 1)
