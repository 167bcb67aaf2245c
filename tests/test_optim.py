"""optim: SGD and AdamW against their formulas recomputed here, step by step;
clip_grad_norm_ (PyTorch's semantics, non-finite norms, other norm types);
nonfinite_report; optimizer state_dict round trip."""
import math

import numpy as np
import pytest

from pdist import Tensor, optim
from pdist.errors import NonFiniteError
from pdist.nn import Parameter


def params_and_grads(seed=0, shapes=((3, 4), (5,))):
    rng = np.random.default_rng(seed)
    ps = [Parameter(rng.standard_normal(s), dtype="float64") for s in shapes]
    return ps, rng


def set_grads(ps, rng):
    gs = [rng.standard_normal(p.shape) for p in ps]
    for p, g in zip(ps, gs):
        p.grad = g.copy()
    return gs


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_formula(wd):
    lr, b1, b2, eps = 1e-2, 0.9, 0.95, 1e-8
    ps, rng = params_and_grads()
    opt = optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ref = [p.data.copy() for p in ps]
    m = [np.zeros_like(r) for r in ref]
    v = [np.zeros_like(r) for r in ref]
    for t in range(1, 6):
        gs = set_grads(ps, rng)
        data_ids = [id(p.data) for p in ps]
        opt.step()
        assert [id(p.data) for p in ps] == data_ids  # updated in place
        for i, g in enumerate(gs):
            ref[i] = ref[i] - lr * wd * ref[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat, vhat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            ref[i] = ref[i] - lr * mhat / (np.sqrt(vhat) + eps)
            np.testing.assert_allclose(ps[i].data, ref[i], rtol=1e-12, atol=1e-14)
    st = opt.state[id(ps[0])]
    assert st["step"] == 5
    np.testing.assert_allclose(st["exp_avg"], m[0], rtol=1e-12)
    np.testing.assert_allclose(st["exp_avg_sq"], v[0], rtol=1e-12)


def test_adamw_first_step_is_lr_sign():
    # bias correction: after one step m_hat = g, v_hat = g^2, so p moves by ~lr*sign(g)
    p = Parameter(np.zeros(4), dtype="float64")
    p.grad = np.array([1e-3, -2.0, 5.0, -1e-2])
    optim.AdamW([p], lr=0.1, weight_decay=0.0, eps=1e-12).step()
    np.testing.assert_allclose(p.data, -0.1 * np.sign(p.grad), rtol=1e-8)


def test_adamw_skips_params_without_grad_and_groups():
    a, b = Parameter(np.ones(2), dtype="float64"), Parameter(np.ones(2), dtype="float64")
    opt = optim.AdamW([{"params": [a], "weight_decay": 0.0}, {"params": [b], "lr": 0.5}], lr=0.1,
                      weight_decay=0.1)
    a.grad = np.ones(2)
    opt.step()
    assert np.all(b.data == 1) and id(b) not in opt.state
    np.testing.assert_allclose(a.data, 1 - 0.1, rtol=1e-7)
    assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[1]["weight_decay"] == 0.1
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.AdamW([])
    with pytest.raises(ValueError, match="invalid"):
        optim.AdamW([a], betas=(1.0, 0.9))


@pytest.mark.parametrize("mu,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.01)])
def test_sgd_matches_formula(mu, wd):
    lr = 0.05
    ps, rng = params_and_grads(1)
    opt = optim.SGD(ps, lr=lr, momentum=mu, weight_decay=wd)
    ref = [p.data.copy() for p in ps]
    buf = [None] * len(ps)
    for _ in range(4):
        gs = set_grads(ps, rng)
        opt.step()
        for i, g in enumerate(gs):
            g = g + wd * ref[i]
            if mu:
                buf[i] = g if buf[i] is None else mu * buf[i] + g
                g = buf[i]
            ref[i] = ref[i] - lr * g
            np.testing.assert_allclose(ps[i].data, ref[i], rtol=1e-12, atol=1e-14)


def test_zero_grad():
    ps, rng = params_and_grads()
    opt = optim.SGD(ps)
    set_grads(ps, rng)
    opt.zero_grad(set_to_none=False)
    assert all(np.all(p.grad == 0) for p in ps)
    opt.zero_grad()
    assert all(p.grad is None for p in ps)


def test_clip_grad_norm():
    ps, rng = params_and_grads(2)
    gs = set_grads(ps, rng)
    total = math.sqrt(sum((g ** 2).sum() for g in gs))
    grad_ids = [id(p.grad) for p in ps]
    n = optim.clip_grad_norm_(ps, max_norm=total / 2)
    assert n == pytest.approx(total, rel=1e-12)
    assert [id(p.grad) for p in ps] == grad_ids  # scaled in place
    new = math.sqrt(sum((p.grad ** 2).sum() for p in ps))
    assert new == pytest.approx(total / 2, rel=1e-5)
    for p, g in zip(ps, gs):
        np.testing.assert_allclose(p.grad, g * (p.grad.flat[0] / g.flat[0]), rtol=1e-12)  # same direction
    gs = set_grads(ps, rng)
    optim.clip_grad_norm_(ps, max_norm=1e6)  # below the limit: untouched
    for p, g in zip(ps, gs):
        np.testing.assert_array_equal(p.grad, g)
    # a sharded strategy all-reduces the squared norm: norm_fn sees the local sum of squares
    seen = []
    n = optim.clip_grad_norm_(ps, 1e6, norm_fn=lambda sq: seen.append(sq) or 4 * sq)
    local = sum((g ** 2).sum() for g in gs)
    assert seen[0] == pytest.approx(local) and n == pytest.approx(2 * math.sqrt(local))


def grads_of(*arrays, names=()):
    ps = [Parameter(np.zeros(len(a)), dtype="float64") for a in arrays]
    for p, a in zip(ps, arrays):
        p.grad = np.array(a, dtype="float64")
    for p, n in zip(ps, names):
        p.name = n
    return ps


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_clip_error_if_nonfinite_raises_and_leaves_grads(bad):
    ps = grads_of([bad, 4.0], [1.0, 2.0], [3.0], names=("blocks.0.w", None))
    before = [p.grad.copy() for p in ps]
    ids = [id(p.grad) for p in ps]
    with pytest.raises(NonFiniteError) as e:
        optim.clip_grad_norm_(ps, max_norm=1.0, error_if_nonfinite=True)
    msg = str(e.value)
    assert "blocks.0.w" in msg and "params[1]" not in msg and "params[2]" not in msg
    assert isinstance(e.value, FloatingPointError)
    for p, b, i in zip(ps, before, ids):
        assert id(p.grad) == i
        np.testing.assert_array_equal(p.grad, b)  # NaN-aware: untouched
    # an unnamed parameter is named by its index in the list
    ps = grads_of([1.0], [2.0, math.nan])
    with pytest.raises(NonFiniteError, match=r"params\[1\]"):
        optim.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)


def test_clip_nonfinite_without_error_behaves_like_pytorch():
    # inf total: factor max_norm / inf = 0, so inf * 0 = NaN and finite entries become 0
    ps = grads_of([math.inf, 4.0])
    n = optim.clip_grad_norm_(ps, max_norm=1.0)
    assert n == math.inf
    assert np.isnan(ps[0].grad[0]) and ps[0].grad[1] == 0.0
    # NaN total: the factor is NaN (clamp keeps NaN), every gradient becomes NaN
    ps = grads_of([math.nan, 4.0], [1.0])
    n = optim.clip_grad_norm_(ps, max_norm=1.0)
    assert math.isnan(n) and all(np.isnan(p.grad).all() for p in ps)


def test_clip_norm_types():
    g = [np.array([3.0, -4.0]), np.array([12.0])]
    for norm_type, total in [(2.0, 13.0), (1, 19.0), (math.inf, 12.0), (3, (27 + 64 + 1728) ** (1 / 3))]:
        ps = grads_of(*g)
        n = optim.clip_grad_norm_(ps, max_norm=total / 4, norm_type=norm_type)
        assert n == pytest.approx(total, rel=1e-12)
        after = np.concatenate([p.grad for p in ps])
        if norm_type == math.inf:
            assert np.abs(after).max() == pytest.approx(total / 4, rel=1e-5)
        else:
            assert (np.abs(after) ** norm_type).sum() ** (1 / norm_type) == pytest.approx(total / 4, rel=1e-5)
    # norm_fn for the inf norm sees the local max |g| (a sharded strategy combines with MAX)
    seen = []
    n = optim.clip_grad_norm_(grads_of(*g), 1e6, norm_type="inf", norm_fn=lambda m: seen.append(m) or 20.0)
    assert seen == [12.0] and n == 20.0
    with pytest.raises(ValueError, match="norm_type"):
        optim.clip_grad_norm_(grads_of(*g), 1.0, norm_type=0)


def test_clip_single_tensor_and_no_grads():
    p = grads_of([3.0, 4.0])[0]
    assert optim.clip_grad_norm_(p, 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(p.grad, [0.6, 0.8], rtol=1e-5)
    q = Parameter(np.zeros(2), dtype="float64")
    assert optim.clip_grad_norm_([q], 1.0) == 0.0 and q.grad is None


CLIP_CASES = {"finite": [[3.0, -4.0], [12.0, 0.5]], "inf": [[math.inf, 4.0], [1.0, 2.0]],
              "nan": [[math.nan, 4.0], [1.0, 2.0]], "small": [[1e-3], [2e-3]]}


@pytest.mark.parametrize("case", sorted(CLIP_CASES))
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_matches_torch(case, norm_type):
    torch = pytest.importorskip("torch")
    arrays = CLIP_CASES[case]
    ps = grads_of(*arrays)
    ts = [torch.zeros(len(a), dtype=torch.float64, requires_grad=True) for a in arrays]
    for t, a in zip(ts, arrays):
        t.grad = torch.tensor(a, dtype=torch.float64)
    n = optim.clip_grad_norm_(ps, max_norm=1.0, norm_type=norm_type)
    tn = torch.nn.utils.clip_grad_norm_(ts, max_norm=1.0, norm_type=norm_type)
    np.testing.assert_allclose(n, tn.item(), rtol=1e-12)
    for p, t in zip(ps, ts):
        np.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=1e-12)  # NaNs in the same places


def test_nonfinite_report():
    ok = {"a": np.ones(3), "b": np.zeros((2, 2))}
    assert optim.nonfinite_report(ok) == []
    assert optim.nonfinite_report(ok, loss=1.5) == []
    assert optim.nonfinite_report(ok, loss=math.nan) == ["loss"]
    bad = [("a", np.ones(3)), ("b", np.array([1.0, np.inf])), ("c", None),
           ("d", Tensor(np.array([[np.nan]]))), ("e", np.array([-np.inf], dtype="float32"))]
    assert optim.nonfinite_report(bad) == ["b", "d", "e"]
    assert optim.nonfinite_report(bad, loss=Tensor(np.array(np.inf))) == ["b", "d", "e", "loss"]
    assert optim.nonfinite_report(ok, loss=np.float32(2.0)) == []
    assert optim.nonfinite_report([], loss=np.array(-np.inf)) == ["loss"]
    assert optim.nonfinite_report([]) == []


def test_optimizer_state_dict_round_trip():
    ps, rng = params_and_grads(3)
    opt = optim.AdamW(ps, lr=1e-2, weight_decay=0.05)
    for _ in range(3):
        set_grads(ps, rng)
        opt.step()
    sd = opt.state_dict()
    assert set(sd["state"]) == {0, 1} and sd["state"][0]["step"] == 3
    assert isinstance(sd["state"][0]["exp_avg"], np.ndarray)
    assert sd["param_groups"][0]["lr"] == 1e-2 and "params" not in sd["param_groups"][0]
    # a second optimizer on a copy of the parameters, restored from the state dict,
    # must continue exactly like the first
    ps2 = [Parameter(p.data.copy(), dtype="float64") for p in ps]
    opt2 = optim.AdamW(ps2, lr=1.0)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2
    sd["state"][0]["exp_avg"][...] = 0  # the loaded state is a copy
    assert not np.all(opt2.state[id(ps2[0])]["exp_avg"] == 0)
    for _ in range(2):
        gs = set_grads(ps, rng)
        for p, g in zip(ps2, gs):
            p.grad = g.copy()
        opt.step()
        opt2.step()
    for p, q in zip(ps, ps2):
        np.testing.assert_array_equal(p.data, q.data)
    with pytest.raises(ValueError, match="optimizer state has 2 param groups, this optimizer has 1"):
        opt2.load_state_dict({"state": {}, "param_groups": [{}, {}]})


def test_sgd_state_dict_round_trip():
    ps, rng = params_and_grads(4)
    opt = optim.SGD(ps, lr=0.1, momentum=0.9)
    set_grads(ps, rng)
    opt.step()
    ps2 = [Parameter(p.data.copy(), dtype="float64") for p in ps]
    opt2 = optim.SGD(ps2, lr=0.1, momentum=0.9)
    opt2.load_state_dict(opt.state_dict())
    gs = set_grads(ps, rng)
    for p, g in zip(ps2, gs):
        p.grad = g.copy()
    opt.step()
    opt2.step()
    for p, q in zip(ps, ps2):
        np.testing.assert_array_equal(p.data, q.data)


def test_adamw_trains_a_tiny_regression():
    from pdist import data, nn
    net = nn.Sequential(nn.Linear(4, 16, rng=np.random.default_rng(0), dtype="float64"), nn.GELU(),
                        nn.Linear(16, 2, rng=np.random.default_rng(1), dtype="float64"))
    opt = optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(150):
        x, y = data.regression_batch(32, 4, 2, seed=0, step=step)
        loss = nn.mse_loss(net(Tensor(x)), Tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10])


def test_adamw_lr_zero_moves_nothing_but_keeps_moments():
    # the update folds lr into a denominator: lr = 0 must not divide by zero
    p = Parameter(np.arange(4.0), dtype="float64")
    p.grad = np.array([1.0, -2.0, 0.5, 0.0])
    opt = optim.AdamW([p], lr=0.0, weight_decay=0.1)
    with np.errstate(all="raise"):
        opt.step()
    np.testing.assert_array_equal(p.data, np.arange(4.0))
    np.testing.assert_allclose(opt.state[id(p)]["exp_avg"], 0.1 * p.grad)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_cache_blocks_match_one_pass(monkeypatch, wd):
    # the host update runs over blocks of optim.BLOCK elements (last block partial): every
    # element must get exactly the update of the whole-array formula, in place
    rng = np.random.default_rng(5)
    p0, g = rng.standard_normal((13, 11)), rng.standard_normal((13, 11))
    out = []
    for block in (7, 10 ** 9):
        monkeypatch.setattr(optim, "BLOCK", block)
        p = Parameter(p0.copy(), dtype="float64")
        opt = optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
        ident = id(p.data)
        for _ in range(3):
            p.grad = g.copy()
            opt.step()
        assert id(p.data) == ident
        out.append((p.data.copy(), opt.state[id(p)]["exp_avg"].copy(), opt.state[id(p)]["exp_avg_sq"].copy()))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
