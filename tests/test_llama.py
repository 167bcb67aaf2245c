"""pdist's Llama against Hugging Face's LlamaForCausalLM in float64 (grouped-query: 4 query
heads, 2 kv heads), loaded through ``pdist.checkpoint.from_pretrained`` from a
``save_pretrained`` directory: logits, loss, every gradient and 5 AdamW steps. Also:
``consolidate`` of a saved one-process checkpoint loads in transformers, and configs pdist's
Llama does not implement are refused (tests/test_llama_model.py: what needs no torch).

HF computes RMSNorm in float32 and the rotary cos/sin from float32 angles whatever the model's
dtype (a mixed-precision policy for bf16 models); the reference here runs those two in float64,
the same formulas (``hf_float64``). Unpatched, HF agrees with pdist to float32's precision.

Optional: skips without torch and transformers."""
import json

import numpy as np
import pytest

from pdist import checkpoint
from pdist.course import lesson
from pdist.engine.autograd import no_grad
from pdist.models.llama import Llama, LlamaConfig
from pdist.parallel.base import Local

torch = transformers = modeling_llama = None  # imported by _torch_and_transformers, not at collection


@pytest.fixture(autouse=True, scope="module")
def _torch_and_transformers():
    """torch and transformers cost seconds to import: once per module when its tests run (a skip
    without them), never while pytest collects."""
    global torch, transformers, modeling_llama
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

HF = dict(vocab_size=29, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=500.0)


def _rms_norm_float64(self, x):
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def _rope_float64(self, x, position_ids):
    d, theta = self.config.head_dim, self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angle = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((angle, angle), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


@pytest.fixture
def hf_float64(monkeypatch):
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_float64)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", _rope_float64)


def hf_model(seed=0):
    """A tiny LlamaForCausalLM in float64, norms away from 1 (so every gradient matters)."""
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).to(torch.float64)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.fixture
def pair(tmp_path, hf_float64):
    hf = hf_model()
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = checkpoint.from_pretrained(str(tmp_path / "hf"))
    assert isinstance(ours, Llama) and ours.config.dtype == "float64"
    assert (ours.config.n_head, ours.config.n_kv_head, ours.config.rope_theta) == (4, 2, 500.0)
    return ours, hf


def batch(seed, B=3, T=16):
    rng = np.random.default_rng(seed)
    return rng.integers(0, HF["vocab_size"], (B, T)), rng.integers(0, HF["vocab_size"], (B, T))


def torch_loss(hf, x, y):
    logits = hf(input_ids=torch.from_numpy(x)).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, HF["vocab_size"]),
                                                     torch.from_numpy(y).reshape(-1))


def test_names_shapes_and_layout_are_hf(pair):
    ours, hf = pair
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert [(n, p.shape) for n, p in ours.named_parameters()] == list(theirs.items())
    assert list(ours.state_dict()) == list(theirs)
    assert ours.config.num_params() == sum(p.numel() for p in hf.parameters())
    attn = ours.model.layers[0].self_attn
    assert (attn.n_head, attn.n_kv_head, attn.q_proj.layout) == (4, 2, "out_in")


def test_logits_loss_and_every_gradient_match_transformers(pair):
    ours, hf = pair
    x, y = batch(1)
    logits, loss = ours(x, y)
    loss.backward()
    tlogits, tloss = torch_loss(hf, x, y)
    tloss.backward()
    np.testing.assert_allclose(logits.data, tlogits.detach().numpy(), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-12)
    params = dict(ours.named_parameters())
    for name, tp in hf.named_parameters():
        np.testing.assert_allclose(params[name].grad, tp.grad.numpy(), rtol=1e-9, atol=1e-13, err_msg=name)


def test_five_adamw_steps_match_transformers(pair):
    ours, hf = pair
    opt = lesson.make_adamw(ours.parameters())
    theirs = dict(hf.named_parameters())
    topt = torch.optim.AdamW([theirs[n] for n, _ in ours.named_parameters()], lr=lesson.LR,
                             betas=lesson.BETAS, eps=lesson.EPS, weight_decay=lesson.WEIGHT_DECAY)
    for step in range(5):
        x, y = batch(10 + step, B=2)
        ours.zero_grad()
        ours(x, y)[1].backward()
        opt.step()
        topt.zero_grad()
        torch_loss(hf, x, y)[1].backward()
        topt.step()
        for name, p in ours.named_parameters():
            np.testing.assert_allclose(p.data, theirs[name].detach().numpy(), rtol=1e-9, atol=1e-12,
                                       err_msg=f"step {step}: {name}")


def test_unpatched_transformers_agrees_to_float32_precision(tmp_path):
    hf = hf_model(seed=1)
    hf.save_pretrained(str(tmp_path))
    ours = checkpoint.from_pretrained(str(tmp_path))
    x, _ = batch(2)
    with no_grad(), torch.no_grad():
        np.testing.assert_allclose(ours(x).data, hf(input_ids=torch.from_numpy(x)).logits.numpy(),
                                   rtol=1e-4, atol=1e-5)


def test_consolidated_checkpoint_loads_in_transformers(tmp_path, hf_float64):
    cfg = LlamaConfig(vocab_size=30, block_size=12, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                      intermediate_size=24, rms_norm_eps=1e-5, rope_theta=300.0, dtype="float64")
    model = Local(Llama(cfg, seed=5))
    opt = lesson.make_adamw(model.parameters())
    x, y = batch(6, T=12)
    x, y = x % 30, y % 30
    model.forward_backward(x, y)
    opt.step()
    checkpoint.save(model, opt, str(tmp_path / "ckpt"), step=1)
    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    assert index["model_type"] == "llama" and index["config"]["n_kv_head"] == 2
    out = checkpoint.consolidate(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert hf.config.num_key_value_heads == 2 and hf.config.rope_parameters["rope_theta"] == 300.0
    with no_grad(), torch.no_grad():
        want = hf(input_ids=torch.from_numpy(x)).logits.numpy()
        np.testing.assert_allclose(model.module(x).data, want, rtol=1e-10, atol=1e-13)
    back = checkpoint.from_pretrained(out).state_dict()
    assert all(np.array_equal(back[k], v) for k, v in model.module.state_dict().items())
    assert "lm_head.weight" in back
    # the other model's config does not load it, naming the model type
    from pdist.models.gpt import GPT, GPTConfig
    with pytest.raises(checkpoint.CheckpointError, match="model_type: checkpoint 'llama' vs model 'gpt2'"):
        checkpoint.load(Local(GPT(GPTConfig(dtype="float64"))), None, str(tmp_path / "ckpt"))


BAD = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True, "mlp_bias": True,
       "hidden_act": "gelu", "tie_word_embeddings": True, "head_dim": 8, "attention_dropout": 0.1}


def test_configs_pdist_does_not_implement_are_refused(tmp_path):
    hf_model().save_pretrained(str(tmp_path))
    good = json.loads((tmp_path / "config.json").read_text())
    for field, value in BAD.items():
        (tmp_path / "config.json").write_text(json.dumps({**good, field: value}))
        with pytest.raises(ValueError, match=f"this config has {field}") as e:
            checkpoint.from_pretrained(str(tmp_path))
        assert str(tmp_path) in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({**good, **BAD}))
    with pytest.raises(ValueError) as e:
        checkpoint.from_pretrained(str(tmp_path))
    assert all(f in str(e.value) for f in BAD), e.value        # one message naming every field
    (tmp_path / "config.json").write_text(json.dumps({**good, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}))
    with pytest.raises(ValueError, match="rope_parameters"):
        checkpoint.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**good, "model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"model_type 'mistral' is not one pdist implements \(gpt2, llama\)"):
        checkpoint.from_pretrained(str(tmp_path))
