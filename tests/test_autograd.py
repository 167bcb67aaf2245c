"""Autograd: every op's gradient against central finite differences in float64
(random shapes, broadcasting, size-1 dims, non-contiguous inputs), gradient
accumulation, hooks, no_grad, and the errors bad inputs raise."""
import numpy as np
import pytest

import pdist
from pdist import Tensor, nn, no_grad
from pdist.engine import ops, shape_ops
from pdist.engine import functional as F

from fdcheck import grads_match


def rnd(*shape, seed=0, lo=None):
    a = np.random.default_rng(seed).standard_normal(shape)
    if lo is not None:  # keep away from 0 (log, div, relu's kink)
        a = np.sign(a) * (np.abs(a) + lo)
    return a


def positive(*shape, seed=0):
    return np.random.default_rng(seed).uniform(0.5, 2.0, shape)


# --- elementwise, with broadcasting and size-1 dims ---------------------------------------
BROADCAST = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1, 4), (2, 4)), ((1, 3), (4, 1)),
             ((2, 1, 3), (1,)), ((5,), (3, 1, 5))]


@pytest.mark.parametrize("sa,sb", BROADCAST)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcast(op, sa, sb):
    a = rnd(*sa, seed=1)
    b = positive(*sb, seed=2) if op == "div" else rnd(*sb, seed=2)
    fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y,
          "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[op]
    ga, gb = grads_match(fn, [a, b])
    assert ga.shape == sa and gb.shape == sb


@pytest.mark.parametrize("op", ["radd", "rsub", "rmul", "rdiv", "python_scalar"])
def test_reflected_and_scalar_operands(op):
    a = positive(3, 4, seed=3)
    c = np.random.default_rng(4).standard_normal((3, 4))  # a plain array on the left
    fn = {"radd": lambda x: c + x, "rsub": lambda x: c - x, "rmul": lambda x: c * x,
          "rdiv": lambda x: c / x, "python_scalar": lambda x: 2.5 - 3.0 * x / 1.5 + 1}[op]
    grads_match(fn, [a])


@pytest.mark.parametrize("name,fn,make", [
    ("neg", lambda x: -x, rnd),
    ("pow3", lambda x: x ** 3, rnd),
    ("pow_frac", lambda x: x ** 0.5, positive),
    ("pow_neg", lambda x: ops.pow(x, -2.0), positive),
    ("exp", lambda x: x.exp(), rnd),
    ("log", lambda x: x.log(), positive),
    ("tanh", lambda x: x.tanh(), rnd),
    ("relu", lambda x: x.relu(), lambda *s, seed=0: rnd(*s, seed=seed, lo=0.1)),
])
@pytest.mark.parametrize("shape", [(7,), (2, 1, 3), (1, 4)])
def test_unary(name, fn, make, shape):
    grads_match(fn, [make(*shape, seed=5)])


def test_relu_zero_below():
    x = Tensor(np.array([-1.0, 2.0, -3.0, 4.0]), requires_grad=True)
    x.relu().sum().backward()
    np.testing.assert_array_equal(x.grad, [0, 1, 0, 1])


def test_pow_rejects_tensor_exponent():
    with pytest.raises(TypeError, match="exponent must be a number"):
        Tensor(np.ones(3)) ** Tensor(np.ones(3))


# --- matmul ----------------------------------------------------------------------------
@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                   ((3, 1, 2, 4), (2, 4, 3)), ((1, 4), (4, 1)), ((2, 3, 4), (1, 4, 2))])
def test_matmul(sa, sb):
    ga, gb = grads_match(lambda a, b: a @ b, [rnd(*sa, seed=6), rnd(*sb, seed=7)])
    assert ga.shape == sa and gb.shape == sb


def test_matmul_non_contiguous():
    base_a = rnd(5, 6, seed=8)
    base_b = rnd(8, 6, seed=9)
    a = base_a.T[::2]  # (3, 5), strided rows of a transposed view
    b = base_b[1:7:1, ::2].T  # (3, 6) -> transposed (3, 6)
    assert not a.flags.c_contiguous and not b.flags.c_contiguous
    grads_match(lambda x, y: x.T @ y, [a, b])


def test_matmul_shape_mismatch_message():
    a, b = Tensor(np.ones((2, 3))), Tensor(np.ones((4, 5)))
    with pytest.raises(ValueError, match=r"matmul: shapes \(2, 3\) and \(4, 5\) do not match") as e:
        a @ b
    assert "last axis of the first (3)" in str(e.value)


def test_linear_shape_mismatch_message():
    with pytest.raises(ValueError, match=r"input has 3 features but the weight is \(4, 2\)"):
        F.linear(Tensor(np.ones((2, 3))), Tensor(np.ones((4, 2))))


# --- reductions ------------------------------------------------------------------------
@pytest.mark.parametrize("axis,keep", [(None, False), (0, False), (-1, True), ((0, 2), False),
                                       ((1,), True)])
@pytest.mark.parametrize("red", ["sum", "mean", "max"])
def test_reductions(red, axis, keep):
    x = np.random.default_rng(10).permutation(24).reshape(2, 3, 4) * 0.1 + rnd(2, 3, 4, seed=11) * 1e-3
    grads_match(lambda t: getattr(t, red)(axis=axis, keepdims=keep), [x])


def test_max_splits_ties_evenly():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), requires_grad=True)
    x.max(axis=1).sum().backward()
    np.testing.assert_array_equal(x.grad, [[0, 0.5, 0.5], [1, 0, 0]])


# --- shapes and indexing -----------------------------------------------------------------
@pytest.mark.parametrize("name,fn", [
    ("reshape", lambda x: x.reshape(4, 6) * x.reshape(4, 6)),
    ("reshape_-1", lambda x: x.reshape(-1, 2).exp()),
    ("view", lambda x: x.view((6, 4)).tanh()),
    ("transpose", lambda x: x.transpose(0, 2) * 1.5),
    ("T", lambda x: x.T @ x),
    ("permute", lambda x: x.permute(2, 0, 1).tanh()),
    ("slice", lambda x: x[:, 1:, ::2] * 2.0),
    ("int", lambda x: x[1] * x[0]),
    ("fancy_repeat", lambda x: x[np.array([0, 1, 1, 0])] ** 2),
    ("fancy_tuple", lambda x: x[np.array([0, 1, 1]), :, np.array([2, 0, 2])] ** 2),
    ("negative_step", lambda x: x[::-1, :, 1:3].exp()),
    ("split", lambda x: shape_ops.concat([p * (i + 1) for i, p in enumerate(x.split([1, 2], axis=1))], axis=1)),
    ("split_equal", lambda x: x.split(2, axis=2)[1].tanh()),
    ("concat_neg_axis", lambda x: shape_ops.concat([x, x.exp(), x[:, :1]], axis=-2)),
])
def test_shape_ops(name, fn):
    grads_match(fn, [rnd(2, 3, 4, seed=12)])


def test_shape_ops_on_non_contiguous_input():
    base = rnd(4, 6, 5, seed=13)
    x = base.transpose(2, 0, 1)[:, ::2]  # (5, 2, 6) strided view
    assert not x.flags.c_contiguous
    grads_match(lambda t: t.reshape(10, 6).T.split(3, axis=0)[1].permute(1, 0).exp(), [x])


def test_permute_and_split_errors():
    x = Tensor(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="not a permutation"):
        x.permute(0, 0, 1)
    with pytest.raises(ValueError, match="does not divide into 2"):
        x.split(2, axis=1)
    with pytest.raises(ValueError, match="do not add up to 3"):
        x.split([1, 1], axis=1)


# --- fused neural-network ops -------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), (4, 1)])
def test_softmax_log_softmax(shape):
    grads_match(lambda x: F.softmax(x), [rnd(*shape, seed=14)])
    grads_match(lambda x: F.log_softmax(x), [rnd(*shape, seed=15)])
    grads_match(lambda x: F.softmax(x, axis=0), [rnd(*shape, seed=16)])


def test_softmax_is_stable_and_normalised():
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1000.0]])
    y = F.softmax(Tensor(x)).data
    np.testing.assert_allclose(y.sum(axis=1), 1.0)
    np.testing.assert_allclose(y[1], 1 / 3)
    assert np.isfinite(F.log_softmax(Tensor(x)).data).all()


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (1, 5, 5), (2, 3, 6)])  # last: 3 queries, 6 keys
def test_scaled_causal_softmax(shape):
    grads_match(lambda x: F.scaled_causal_softmax(x, scale=0.7), [rnd(*shape, seed=17)])
    T, S = shape[-2:]
    x = rnd(*shape, seed=18)
    y = F.scaled_causal_softmax(Tensor(x), scale=0.7).data
    # reference: mask future keys (key j visible to query i iff j <= i + S - T)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    z = np.where(j <= i + S - T, 0.7 * x, -np.inf)
    ref = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(y, ref / ref.sum(-1, keepdims=True), rtol=1e-12)


def _composed_attention(qkv, n_head):
    """The same attention from small ops (reshape, permute, slices, matmuls, softmax)."""
    B, T, C3 = qkv.shape
    hs = C3 // (3 * n_head)
    qkv = qkv.reshape(B, T, 3, n_head, hs).permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hs)
    att = F.scaled_causal_softmax(qkv[0] @ qkv[1].transpose(-2, -1), 1.0 / np.sqrt(hs))
    return (att @ qkv[2]).permute(0, 2, 1, 3).reshape(B, T, n_head * hs)


@pytest.mark.parametrize("B,T,nh,hs", [(2, 5, 3, 4), (1, 1, 1, 2), (3, 4, 2, 3)])
def test_fused_causal_attention(B, T, nh, hs):
    from pdist.engine.attention import causal_self_attention
    grads_match(lambda x: causal_self_attention(x, nh), [rnd(B, T, 3 * nh * hs, seed=21)])
    x, g = rnd(B, T, 3 * nh * hs, seed=22), rnd(B, T, nh * hs, seed=23)
    got = []
    for f in (causal_self_attention, _composed_attention):
        t = Tensor(x, requires_grad=True)
        y = f(t, nh)
        y.backward(g)
        got.append((y.data, t.grad))
    np.testing.assert_allclose(got[0][0], got[1][0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(got[0][1], got[1][1], rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="qkv width"):
        causal_self_attention(Tensor(rnd(1, 2, 7)), 1)


def test_causal_blocks_and_batch_chunks_match_one_block(monkeypatch):
    # T = 150: query blocks of 64, 64 and a partial 22, each seeing only the keys before
    # its end; batch chunks of one row. Values and gradients must be those of one block
    # over the whole (T, T) scores (to rounding: dv, dk add the blocks' shares), the
    # finite-difference gradient must hold across block edges, and P keeps 1/T^2 less
    import pdist.engine.attention as A
    from pdist.engine.attention import causal_self_attention
    B, T, nh, hs = 3, 150, 2, 4
    x, g = rnd(B, T, 3 * nh * hs, seed=24), rnd(B, T, nh * hs, seed=25)

    def run(qblock, chunk_bytes):
        monkeypatch.setattr(A, "QBLOCK", qblock)
        monkeypatch.setattr(A, "CHUNK_BYTES", chunk_bytes)
        t = Tensor(x, requires_grad=True)
        y = causal_self_attention(t, nh)
        saved = sum(p.size for p in y._ctx.P)
        y.backward(g)
        return y.data, t.grad, saved

    y1, g1, s1 = run(T, 1 << 40)
    yb, gb, sb = run(64, 1)
    assert s1 == B * nh * T * T and sb == B * nh * A.saved_scores(T, 64) == B * nh * (64 * 64 + 64 * 128 + 22 * 150)
    np.testing.assert_allclose(yb, y1, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(gb, g1, rtol=1e-12, atol=1e-14)
    monkeypatch.setattr(A, "QBLOCK", 3)
    grads_match(lambda t: causal_self_attention(t, 1), [rnd(2, 8, 6, seed=26)])


def test_gelu_cache_blocks_match_one_pass(monkeypatch):
    # on the host GELU runs over blocks of activations.BLOCK elements (last one partial): the
    # values and the gradient must be exactly those of one pass over the whole array
    from pdist.engine import activations
    x, g = rnd(5, 7, seed=24) * 2, rnd(5, 7, seed=25)
    out = []
    for block in (4, 10 ** 9):
        monkeypatch.setattr(activations, "BLOCK", block)
        t = Tensor(x, requires_grad=True)
        y = F.gelu(t)
        y.backward(g)
        out.append((y.data, t.grad))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])
    u = 0.7978845608028654 * (x + 0.044715 * x ** 3)
    np.testing.assert_allclose(out[0][0], 0.5 * x * (1 + np.tanh(u)), rtol=1e-14, atol=1e-15)
    # a non-contiguous input takes the one-pass path
    xt = np.asfortranarray(x)
    np.testing.assert_allclose(F.gelu(Tensor(xt)).data, out[0][0], rtol=1e-15)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 5)])
def test_gelu(shape):
    x = rnd(*shape, seed=19) * 2
    grads_match(F.gelu, [x])
    k = np.sqrt(2 / np.pi)
    np.testing.assert_allclose(F.gelu(Tensor(x)).data, 0.5 * x * (1 + np.tanh(k * (x + 0.044715 * x**3))))


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 5), (3, 1)])
def test_layer_norm(shape):
    C = shape[-1]
    x, w, b = rnd(*shape, seed=20), rnd(C, seed=21), rnd(C, seed=22)
    grads_match(lambda x, w, b: F.layer_norm(x, w, b), [x, w, b], rtol=1e-5, atol=1e-7)
    y = F.layer_norm(Tensor(x), Tensor(w), Tensor(b)).data
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)


def test_layer_norm_non_contiguous():
    base = rnd(6, 4, seed=23)
    x = base.T  # (4, 6), transposed view
    grads_match(lambda x, w, b: F.layer_norm(x, w, b), [x, rnd(6, seed=24), rnd(6, seed=25)],
                rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("xshape,bias", [((4, 3), True), ((2, 5, 3), True), ((2, 5, 3), False)])
def test_linear(xshape, bias):
    arrays = [rnd(*xshape, seed=26), rnd(3, 4, seed=27)] + ([rnd(4, seed=28)] if bias else [])
    grads_match(lambda x, w, *b: F.linear(x, w, *b), arrays)


def test_linear_transposed_weight():
    # GPT's tied head: logits = h @ wte^T, the weight is a transposed view
    grads_match(lambda h, e: F.linear(h, e.T), [rnd(2, 3, 4, seed=29), rnd(5, 4, seed=30)])


def test_embedding_repeated_rows_add():
    idx = np.array([[0, 2, 2], [4, 0, 2]])
    w = rnd(5, 3, seed=31)
    (gw,) = grads_match(lambda w: F.embedding(idx, w), [w])
    assert np.all(gw[[1, 3]] == 0)  # rows never looked up get no gradient


def test_embedding_bad_indices_messages():
    w = Tensor(np.zeros((5, 3)))
    with pytest.raises(TypeError, match="embedding index must be an integer array, got float64"):
        F.embedding(np.array([0.0, 1.0]), w)
    with pytest.raises(IndexError, match=r"out of range: values span \[0, 5\] but must lie in \[0, 5\)"):
        F.embedding(np.array([0, 5]), w)
    with pytest.raises(IndexError, match=r"values span \[-1, 1\]"):
        F.embedding(np.array([-1, 1]), w)


def test_dropout_gradient_and_scaling():
    x = rnd(4, 5, seed=32)
    # a fresh generator with the same seed per call, so every evaluation draws the same mask
    grads_match(lambda t: F.dropout(t, 0.3, rng=np.random.default_rng(7)), [x])
    y = F.dropout(Tensor(np.ones((200, 50))), 0.3, rng=np.random.default_rng(7)).data
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.7)
    assert abs(kept.mean() - 0.7) < 0.02


def test_dropout_identity_when_off_and_needs_rng():
    x = Tensor(np.ones(3))
    assert F.dropout(x, 0.5, training=False, rng=np.random.default_rng(0)) is x
    assert F.dropout(x, 0.0) is x
    with pytest.raises(ValueError, match="explicit rng"):
        F.dropout(x, 0.5)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        F.dropout(x, 1.0, rng=np.random.default_rng(0))


@pytest.mark.parametrize("shape,ignore", [((6, 5), None), ((2, 3, 5), None), ((2, 4, 5), 1)])
def test_cross_entropy(shape, ignore):
    rng = np.random.default_rng(33)
    t = rng.integers(0, shape[-1], shape[:-1])
    if ignore is not None:
        t[0, :2] = ignore
    z = rnd(*shape, seed=34) * 3
    grads_match(lambda z: F.cross_entropy(z, t, ignore_index=ignore), [z])
    # value: mean over counted rows of -log softmax(z)[target]
    z2, t2 = z.reshape(-1, shape[-1]), t.reshape(-1)
    lse = np.log(np.exp(z2).sum(1))
    nll = lse - z2[np.arange(len(t2)), t2]
    keep = np.ones(len(t2), bool) if ignore is None else t2 != ignore
    loss = F.cross_entropy(Tensor(z), t, ignore_index=ignore).item()
    np.testing.assert_allclose(loss, nll[keep].mean(), rtol=1e-12)


def test_cross_entropy_stable_for_huge_logits():
    z = Tensor(np.array([[1e4, 0.0, -1e4]]), requires_grad=True)
    loss = F.cross_entropy(z, np.array([1]))
    loss.backward()
    assert np.isclose(loss.item(), 1e4) and np.isfinite(z.grad).all()


def test_cross_entropy_bad_targets_messages():
    z = Tensor(np.zeros((2, 3, 4)))
    with pytest.raises(TypeError, match="cross_entropy target must be an integer array, got float64"):
        F.cross_entropy(z, np.zeros((2, 3)))
    with pytest.raises(IndexError, match=r"cross_entropy target out of range: .* \[0, 4\)"):
        F.cross_entropy(z, np.full((2, 3), 4))
    with pytest.raises(ValueError, match="6 rows of logits but 5 targets"):
        F.cross_entropy(z, np.zeros(5, dtype=np.int64))


def test_mse_loss():
    p, t = rnd(3, 4, seed=35), rnd(3, 4, seed=36)
    grads_match(lambda p: nn.mse_loss(p, Tensor(t)), [p])
    np.testing.assert_allclose(F.mse_loss(Tensor(p), Tensor(t)).item(), ((p - t) ** 2).mean())


def test_composite_graph_reuses_a_tensor_many_times():
    # a diamond: x feeds several paths that meet again
    def fn(x, w):
        h = (x @ w).tanh()
        return F.layer_norm(h + x @ w * h, Tensor(np.ones(4)), Tensor(np.zeros(4))).sum(axis=0) + h.mean()
    grads_match(fn, [rnd(3, 2, seed=37), rnd(2, 4, seed=38)], rtol=1e-5)


# --- autograd mechanics ----------------------------------------------------------------
def test_gradients_accumulate_until_zero_grad():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x * x).sum().backward()
    g1 = x.grad
    (x * 3.0).sum().backward()
    assert x.grad is g1  # accumulated in place into the existing array
    np.testing.assert_allclose(x.grad, 2 * x.data + 3.0)
    lin = nn.Linear(2, 2, rng=np.random.default_rng(0), dtype="float64")
    lin(Tensor(np.ones((1, 2)))).sum().backward()
    lin.zero_grad()
    assert all(p.grad is None for p in lin.parameters())


def test_accumulates_into_a_view_of_a_flat_buffer():
    flat = np.zeros(6)
    w = Tensor(np.ones((2, 3)), requires_grad=True)
    w.grad = flat[:6].reshape(2, 3)  # what a bucketed DDP does
    (w * 2.0).sum().backward()
    np.testing.assert_allclose(flat, 2.0)


def test_backward_needs_scalar_or_grad():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="needs a scalar"):
        (x * 2).backward()
    (x * 2).backward(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(x.grad, [2, 4, 6])
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(1)).sum().backward()


def test_no_grad_builds_no_graph():
    x = Tensor(np.ones(3), requires_grad=True)
    with no_grad():
        y = (x * 2).sum()
        assert not pdist.is_grad_enabled()
    assert pdist.is_grad_enabled()
    assert not y.requires_grad and y.is_leaf
    with pytest.raises(RuntimeError):
        y.backward()


def test_detach_stops_gradient():
    x = Tensor(np.array([2.0]), requires_grad=True)
    (x * x.detach()).sum().backward()
    np.testing.assert_allclose(x.grad, [2.0])


def test_graph_freed_after_backward():
    x = Tensor(np.ones(2), requires_grad=True)
    y = (x * 2).sum()
    y.backward()
    assert y._ctx is None


def test_register_hook_sees_and_replaces_gradient():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    h = x * 3.0
    seen = []
    h.register_hook(lambda g: seen.append(g.copy()))
    h.register_hook(lambda g: g * 10)
    (h * h).sum().backward()
    np.testing.assert_allclose(seen[0], 2 * h.data)  # dL/dh before replacement
    np.testing.assert_allclose(x.grad, 2 * h.data * 10 * 3)
    # hooks on leaves run before accumulation; handles remove them
    y = Tensor(np.ones(2), requires_grad=True)
    handle = y.register_hook(lambda g: g * 0)
    (y * 2).sum().backward()
    np.testing.assert_allclose(y.grad, 0)
    handle.remove()
    (y * 2).sum().backward()
    np.testing.assert_allclose(y.grad, 2)


def test_post_accumulate_hook_fires_once_after_last_contribution():
    rng = np.random.default_rng(39)
    w1 = Tensor(rng.standard_normal((3, 3)), requires_grad=True)
    w2 = Tensor(rng.standard_normal((3, 3)), requires_grad=True)
    x = Tensor(rng.standard_normal((2, 3)))
    events = []

    def hook(t):
        events.append((t.name, t.grad.copy()))
    w1.name, w2.name = "w1", "w2"
    w1.register_post_accumulate_grad_hook(hook)
    w2.register_post_accumulate_grad_hook(hook)
    # w1 is used three times (early and late in the graph), w2 once in the middle
    h = (x @ w1).tanh()
    h = (h @ w2) @ w1
    loss = (h @ w1).sum()
    loss.backward()
    assert [n for n, _ in events] == ["w2", "w1"]  # each once; w1 after its last (earliest) use
    np.testing.assert_allclose(events[1][1], w1.grad)  # the complete gradient
    # and the complete gradient is right
    grads_match(lambda a, b: ((((Tensor(x.data) @ a).tanh() @ b) @ a) @ a).sum(),
                [w1.data.copy(), w2.data.copy()])
    with pytest.raises(RuntimeError, match="leaf"):
        (w1 * 2).register_post_accumulate_grad_hook(hook)


def test_post_accumulate_hooks_fire_in_reverse_layer_order():
    layers = [nn.Linear(4, 4, rng=np.random.default_rng(i), dtype="float64") for i in range(3)]
    order = []
    for i, lin in enumerate(layers):
        lin.weight.register_post_accumulate_grad_hook(lambda t, i=i: order.append(i))
    h = Tensor(np.ones((2, 4)))
    for lin in layers:
        h = lin(h).tanh()
    h.sum().backward()
    assert order == [2, 1, 0]


def test_module_forward_hooks():
    lin = nn.Linear(3, 2, rng=np.random.default_rng(0), dtype="float64")
    calls = []
    lin.register_forward_pre_hook(lambda m, args: calls.append(("pre", m)) or (args[0] * 2.0,))
    lin.register_forward_hook(lambda m, args, out: calls.append(("post", out.shape)) or out + 1.0)
    x = Tensor(np.ones((4, 3)))
    y = lin(x)
    assert calls == [("pre", lin), ("post", (4, 2))]
    np.testing.assert_allclose(y.data, 2.0 * np.ones((4, 3)) @ lin.weight.data + lin.bias.data + 1.0)


@pytest.mark.parametrize("index", [np.array([3, 0, 3, 3, 1, 0]), np.array([2]), np.array([], dtype=np.int64),
                                   np.array([-1, 3, 0, -4])])
@pytest.mark.parametrize("one_hot_rows", [256, 0], ids=["one-hot GEMM", "sorted runs"])
def test_scatter_add_adds_repeated_rows(index, one_hot_rows, monkeypatch):
    import pdist.engine.backend as backend
    monkeypatch.setattr(backend, "ONE_HOT_ROWS", one_hot_rows)
    rng = np.random.default_rng(40)
    a = rng.standard_normal((4, 3))
    vals = rng.standard_normal((len(index), 3))
    ref = a.copy()
    for i, v in zip(index, vals):  # the definition, one row at a time
        ref[i] += v
    backend.scatter_add(a, index, vals)
    np.testing.assert_allclose(a, ref, rtol=1e-14)


def test_autograd_does_not_import_ops():
    """No import cycle autograd <-> ops (lazy imports included): ops (and shape_ops)
    attach Tensor's operators on import, and the package imports both. Nor does the
    backward walk (backprop.py) that autograd imports."""
    import ast
    import pathlib
    engine = pathlib.Path(pdist.__file__).parent / "engine"
    for name in ("autograd.py", "backprop.py"):
        imported = set()
        for node in ast.walk(ast.parse((engine / name).read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module or "")
                imported.update(f"{node.module}.{a.name}" for a in node.names)
        bad = [m for m in imported for op in ("pdist.engine.ops", "pdist.engine.shape_ops")
               if m == op or m.startswith(op + ".")]
        assert not bad, (name, bad)


def test_tensor_methods_present_after_importing_only_autograd():
    import subprocess
    import sys
    code = ("import numpy as np\nfrom pdist.engine.autograd import Tensor\n"
            "x = Tensor(np.ones((2, 3)), requires_grad=True)\n"
            "(x @ Tensor(np.ones((3, 1)))).reshape(2).sum().backward()\n"
            "assert float(x.grad.sum()) == 6.0\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_engine_sums_in_place_and_adopts_only_arrays_nobody_else_holds(monkeypatch):
    # Functions with fresh_grads hand the engine new arrays: it sums into them in place and
    # makes them .grad without a copy. Arrays it does not own (Add hands the same g to both
    # parents; a hook keeps what it saw) are never written, and the values are exactly the
    # out-of-place ones.
    x0, w0, b0 = rnd(4, 3, seed=30), rnd(3, 3, seed=31), rnd(3, seed=32)
    seen, made = [], []
    orig = F.Linear.backward

    def spy(self, g):
        out = orig(self, g)
        made.append(out[1])
        return out
    monkeypatch.setattr(F.Linear, "backward", spy)

    def run():
        x, w, b = (Tensor(a.copy(), requires_grad=True) for a in (x0, w0, b0))
        h = x * 1.0
        h.register_hook(lambda g: seen.append((g, g.copy())))
        y = F.linear(h, w, b) + h      # h's gradient: Linear's (fresh) + Add's (shared)
        z = F.linear(y, w) + y         # w: two fresh contributions, summed in place
        (z * z).sum().backward()
        return x, w, b

    x, w, b = run()
    assert w.grad is made[0]                             # the second dW added into the first, no copy
    kept, copy = seen[0]
    np.testing.assert_array_equal(kept, copy)            # the hook's array was never written
    # the same graph without the engine's in-place paths (every Function not fresh)
    grads = x.grad.copy(), w.grad.copy(), b.grad.copy()
    for cls in (F.Linear,):
        monkeypatch.setattr(cls, "fresh_grads", False)
    x2, w2, b2 = run()
    for got, want in zip(grads, (x2.grad, w2.grad, b2.grad)):
        np.testing.assert_array_equal(got, want)
    assert not any(w2.grad is m for m in made)           # not owned: copied
    # .grad is the caller's from then on: a second backward adds into it
    w = Tensor(w0.copy(), requires_grad=True)
    for _ in range(2):
        F.linear(Tensor(x0), w).sum().backward()
    np.testing.assert_array_equal(w.grad, 2 * x0.sum(0)[:, None] * np.ones(3))
