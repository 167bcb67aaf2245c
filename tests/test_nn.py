"""nn: modules, state_dict round trips and their errors, GPT-2's names and shapes,
layout-independent init, and spot checks of GPT's gradients (float64)."""
import zlib

import numpy as np
import pytest

from pdist import Tensor, nn
from pdist.engine import functional as F
from pdist.models.gpt import GPT, GPTConfig, gpt_init
from pdist.engine.gradcheck import central_difference

CFG = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64")


def tiny(seed=0, **kw):
    return GPT(GPTConfig(**{**CFG, **kw}), seed=seed)


def batch(cfg, B=2, T=None, seed=0):
    rng = np.random.default_rng(seed)
    T = T or cfg.block_size
    return rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))


# --- Module basics -----------------------------------------------------------------------
def test_named_parameters_and_sequential_names():
    net = nn.Sequential(nn.Linear(3, 4, rng=np.random.default_rng(0)), nn.ReLU(),
                        nn.Linear(4, 2, bias=False, rng=np.random.default_rng(1)))
    names = [n for n, _ in net.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight"]
    assert net[0].weight.shape == (3, 4)  # W stored (in, out)
    assert net.num_parameters() == 3 * 4 + 4 + 4 * 2
    x = np.random.default_rng(2).standard_normal((5, 3)).astype(np.float32)
    ref = np.maximum(x @ net[0].weight.data + net[0].bias.data, 0) @ net[2].weight.data
    np.testing.assert_allclose(net(Tensor(x)).data, ref, rtol=1e-5)


def test_linear_init_is_pytorch_uniform():
    lin = nn.Linear(400, 300, rng=np.random.default_rng(0), dtype="float64")
    k = 1 / np.sqrt(400)
    assert np.abs(lin.weight.data).max() <= k and np.abs(lin.weight.data).max() > 0.95 * k
    assert lin.weight.dtype == np.float64


def test_train_eval_propagates():
    m = tiny()
    assert all(x.training for x in m.modules())
    m.eval()
    assert not any(x.training for x in m.modules())
    m.train()
    assert all(x.training for x in m.modules())


def test_dropout_off_by_default_and_seeded():
    cfg = GPTConfig(**CFG)
    assert cfg.dropout == 0.0
    x, _ = batch(cfg)
    np.testing.assert_array_equal(tiny()(x).data, tiny()(x).data)
    a, b, c = tiny(dropout=0.2), tiny(dropout=0.2), tiny(dropout=0.2, seed=1)
    c.load_state_dict(a.state_dict())
    la, lb, lc = a(x).data, b(x).data, c(x).data
    np.testing.assert_array_equal(la, lb)  # same seed -> same masks
    assert not np.allclose(la, lc)  # another seed -> other masks
    a.eval()
    np.testing.assert_allclose(a(x).data, tiny()(x).data, rtol=1e-12)  # eval: dropout off
    drop = nn.Dropout(0.5, seed=3)
    y = drop(Tensor(np.ones((50, 40))))
    assert 0.4 < (y.data == 0).mean() < 0.6
    drop.eval()
    assert np.all(drop(Tensor(np.ones(4))).data == 1)


# --- state_dict --------------------------------------------------------------------------
def test_gpt_state_dict_has_hf_names_and_shapes():
    cfg = GPTConfig(**CFG)
    sd = tiny().state_dict()
    C, V = cfg.n_embd, cfg.vocab_size
    assert list(sd) == list(cfg.param_shapes())
    assert sd["transformer.wte.weight"].shape == (V, C)
    assert sd["transformer.wpe.weight"].shape == (cfg.block_size, C)
    assert sd["transformer.h.1.attn.c_attn.weight"].shape == (C, 3 * C)
    assert sd["transformer.h.0.mlp.c_fc.weight"].shape == (C, 4 * C)
    assert sd["transformer.h.0.mlp.c_proj.weight"].shape == (4 * C, C)
    assert "lm_head.weight" not in sd  # tied to wte
    n = sum(v.size for v in sd.values())
    L = cfg.n_layer
    assert n == V * C + cfg.block_size * C + L * (12 * C * C + 13 * C) + 2 * C
    assert all(isinstance(v, np.ndarray) for v in sd.values())


def test_state_dict_round_trip_and_copy_semantics():
    a, b = tiny(seed=0), tiny(seed=1)
    x, _ = batch(a.config)
    assert not np.allclose(a(x).data, b(x).data)
    sd = a.state_dict()
    sd_before = {k: v.copy() for k, v in sd.items()}
    b.load_state_dict(sd)
    np.testing.assert_array_equal(a(x).data, b(x).data)
    for k, v in b.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])
    # state_dict returns copies, and load_state_dict copies in (no aliasing either way)
    sd["transformer.wte.weight"][...] = 0
    assert not np.all(a.transformer.wte.weight.data == 0)
    assert not np.all(b.transformer.wte.weight.data == 0)
    b.transformer.ln_f.bias.data += 1
    np.testing.assert_array_equal(a.state_dict()["transformer.ln_f.bias"], sd_before["transformer.ln_f.bias"])


def test_load_state_dict_casts_and_accepts_hf_extras():
    a = tiny()
    b = GPT(GPTConfig(**{**CFG, "dtype": "float32"}), seed=5)
    sd = a.state_dict()
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # as in a Hugging Face checkpoint
    sd["transformer.h.0.attn.bias"] = np.ones((1, 1, 8, 8))
    b.load_state_dict(sd)
    assert b.transformer.wte.weight.dtype == np.float32
    np.testing.assert_allclose(b.transformer.wte.weight.data, sd["transformer.wte.weight"], rtol=1e-6)


def test_load_state_dict_errors_say_what_is_wrong():
    m = tiny()
    sd = m.state_dict()
    missing = dict(sd)
    del missing["transformer.h.1.ln_2.bias"]
    with pytest.raises(KeyError, match=r"missing keys: \['transformer.h.1.ln_2.bias'\]"):
        m.load_state_dict(missing)
    extra = dict(sd, **{"transformer.h.9.mlp.c_fc.weight": np.zeros((8, 32))})
    with pytest.raises(KeyError, match=r"unexpected keys: \['transformer.h.9.mlp.c_fc.weight'\]"):
        m.load_state_dict(extra)
    bad = dict(sd)
    bad["transformer.h.0.attn.c_attn.weight"] = np.zeros((24, 8))  # transposed (PyTorch Linear layout)
    with pytest.raises(KeyError, match=r"shape mismatch: transformer.h.0.attn.c_attn.weight: "
                                       r"checkpoint \(24, 8\) vs model \(8, 24\)"):
        m.load_state_dict(bad)
    before = m.state_dict()
    with pytest.raises(KeyError):
        m.load_state_dict(bad)
    for k, v in m.state_dict().items():  # a failed load changes nothing
        np.testing.assert_array_equal(v, before[k])
    # strict=False loads a subset, but never a wrong shape
    m.load_state_dict({"transformer.ln_f.bias": np.full(8, 2.0)}, strict=False)
    assert np.all(m.transformer.ln_f.bias.data == 2.0)
    with pytest.raises(KeyError, match="shape mismatch"):
        m.load_state_dict({"transformer.ln_f.bias": np.zeros(9)}, strict=False)


def test_config_errors():
    with pytest.raises(ValueError, match="n_embd=10 must be divisible by n_head=4"):
        GPTConfig(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="dtype"):
        GPTConfig(dtype="float16")
    m = tiny()
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size 8"):
        m(np.zeros((1, 9), dtype=np.int64))
    with pytest.raises(TypeError, match="integer array, got float64"):
        m(np.zeros((1, 4)))
    with pytest.raises(IndexError, match=r"must lie in \[0, 11\)"):
        m(np.full((1, 4), 11))


# --- initialisation independent of the layout ----------------------------------------------
def test_gpt_init_depends_only_on_seed_and_name():
    cfg = GPTConfig(**CFG)
    big = GPTConfig(**{**CFG, "n_layer": 4})
    m = tiny(seed=3)
    for name, p in m.named_parameters():
        np.testing.assert_array_equal(p.data, gpt_init(cfg, name, 3))
    # the same named tensor in a deeper model (a pipeline stage's view) is the same draw,
    # except the residual projections, whose std is 0.02/sqrt(2 n_layer) by GPT-2's rule
    for name in ["transformer.h.1.attn.c_attn.weight", "transformer.wte.weight"]:
        np.testing.assert_array_equal(gpt_init(cfg, name, 3), gpt_init(big, name, 3))
    proj = "transformer.h.1.mlp.c_proj.weight"
    r = gpt_init(cfg, proj, 3) / gpt_init(big, proj, 3)
    np.testing.assert_allclose(r, np.sqrt(2 * 4) / np.sqrt(2 * 2))
    # a tensor-parallel rank slicing the master weight gets exactly its columns
    full = gpt_init(cfg, "transformer.h.0.mlp.c_fc.weight", 3)
    shard = m.transformer.h[0].mlp.c_fc.weight.data[:, 16:]
    np.testing.assert_array_equal(np.split(full, 2, axis=1)[1], shard)
    # the draw is the name's own generator: (seed, crc32(name)), N(0, 0.02)
    name = "transformer.h.0.attn.c_attn.weight"
    ref = np.random.default_rng([3, zlib.crc32(name.encode())]).standard_normal((8, 24)) * 0.02
    np.testing.assert_array_equal(gpt_init(cfg, name, 3), ref)
    assert not np.allclose(gpt_init(cfg, name, 3), gpt_init(cfg, name, 4))
    assert not np.allclose(gpt_init(cfg, name, 3), gpt_init(cfg, "transformer.h.1.attn.c_attn.weight", 3))
    # biases 0, LayerNorm weights 1
    assert np.all(gpt_init(cfg, "transformer.h.0.ln_1.weight", 3) == 1)
    assert np.all(gpt_init(cfg, "transformer.h.0.attn.c_proj.bias", 3) == 0)


def test_float32_model_is_the_float64_model_rounded():
    a, b = tiny(seed=2), tiny(seed=2, dtype="float32")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert q.dtype == np.float32
        np.testing.assert_array_equal(q.data, p.data.astype(np.float32))


# --- GPT forward / backward spot checks ---------------------------------------------------
def reference_logits(sd, cfg, idx):
    """GPT-2 forward written out in NumPy, independent of pdist's ops."""
    C, nh = cfg.n_embd, cfg.n_head
    B, T = idx.shape

    def ln(h, p):
        xhat = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
        return xhat * sd[p + ".weight"] + sd[p + ".bias"]

    def lin(h, p):
        return h @ sd[p + ".weight"] + sd[p + ".bias"]

    h = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:T]
    mask = np.triu(np.ones((T, T), bool), 1)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        qkv = lin(ln(h, p + "ln_1"), p + "attn.c_attn")
        q, k, v = [qkv[..., j * C:(j + 1) * C].reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)
                   for j in range(3)]
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(C // nh)
        att[..., mask] = -np.inf
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        h = h + lin(y, p + "attn.c_proj")
        u = lin(ln(h, p + "ln_2"), p + "mlp.c_fc")
        u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
        h = h + lin(u, p + "mlp.c_proj")
    return ln(h, "transformer.ln_f") @ sd["transformer.wte.weight"].T


def test_gpt_forward_matches_numpy_reference():
    m = tiny(seed=4)
    # perturb biases and LayerNorms so that every parameter matters
    rng = np.random.default_rng(0)
    for n, p in m.named_parameters():
        p.data += 0.1 * rng.standard_normal(p.shape)
    x, _ = batch(m.config, B=3, T=6)
    ref = reference_logits(m.state_dict(), m.config, x)
    np.testing.assert_allclose(m(x).data, ref, rtol=1e-10, atol=1e-12)


def test_gpt_is_causal():
    m = tiny(seed=1)
    x, _ = batch(m.config)
    x2 = x.copy()
    x2[:, 5:] = (x2[:, 5:] + 1) % m.config.vocab_size
    a, b = m(x).data, m(x2).data
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-12)
    assert not np.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("name,idx", [
    ("transformer.wte.weight", (3, 1)),
    ("transformer.wpe.weight", (2, 5)),
    ("transformer.h.0.ln_1.weight", (4,)),
    ("transformer.h.0.attn.c_attn.weight", (2, 13)),
    ("transformer.h.0.attn.c_attn.bias", (9,)),  # a key bias
    ("transformer.h.1.attn.c_proj.weight", (7, 0)),
    ("transformer.h.1.mlp.c_fc.bias", (30,)),
    ("transformer.h.1.mlp.c_proj.weight", (17, 6)),
    ("transformer.ln_f.bias", (1,)),
])
def test_gpt_gradient_spot_checks(name, idx):
    m = tiny(seed=6)
    rng = np.random.default_rng(1)
    for n, p in m.named_parameters():
        p.data += 0.05 * rng.standard_normal(p.shape)
    x, y = batch(m.config, seed=2)
    x[0, 0] = 3  # make sure wte row 3 is used
    _, loss = m(x, y)
    loss.backward()
    p = dict(m.named_parameters())[name]
    num = central_difference(lambda: m(x, y)[1].item(), p.data, idx)
    np.testing.assert_allclose(p.grad[idx], num, rtol=1e-5, atol=1e-9)


def test_gpt_loss_and_gradient_shapes():
    m = tiny()
    x, y = batch(m.config)
    logits, loss = m(x, y)
    assert logits.shape == (2, 8, 11)
    assert abs(loss.item() - np.log(11)) < 0.1  # small init: near-uniform predictions
    loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, n


def test_generate_extends_and_is_seeded():
    m = tiny()
    out = m.generate(np.array([[1, 2, 3]]), 12, seed=0)
    assert out.shape == (1, 15) and (out[:, :3] == [1, 2, 3]).all()
    assert out.max() < 11
    np.testing.assert_array_equal(out, m.generate(np.array([[1, 2, 3]]), 12, seed=0))


def test_modules_compose_with_functional_losses():
    net = nn.Sequential(nn.Linear(4, 8, rng=np.random.default_rng(0), dtype="float64"), nn.GELU(),
                        nn.LayerNorm(8, dtype="float64"),
                        nn.Linear(8, 3, rng=np.random.default_rng(1), dtype="float64"))
    x = np.random.default_rng(2).standard_normal((5, 4))
    loss = F.cross_entropy(net(Tensor(x)), np.array([0, 1, 2, 1, 0]))
    loss.backward()
    assert all(p.grad is not None for p in net.parameters())
    emb = nn.Embedding(6, 3, rng=np.random.default_rng(0), dtype="float64")
    np.testing.assert_array_equal(emb(np.array([5, 0])).data, emb.weight.data[[5, 0]])
