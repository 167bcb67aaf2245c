"""pdist's Llama without torch: meta init equals the materialized model to the bit, recompute
modes give bit-equal gradients, mixed precision trains, configs are validated, and the
checkpoint index names the model (an index without ``model_type`` is GPT-2's).
(tests/test_llama.py: the same model against transformers.)"""
import dataclasses
import json
import os
import re

import numpy as np
import pytest

from pdist import checkpoint
from pdist.course import lesson
from pdist.models.gpt import GPT, GPTConfig
from pdist.models.llama import Llama, LlamaConfig, llama_init
from pdist.parallel.base import Local

CFG = LlamaConfig(vocab_size=30, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                  intermediate_size=24, dtype="float64")


def batch(seed, B=3, T=8, V=30):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def test_meta_init_equals_materialized_to_the_bit(monkeypatch):
    import pdist.engine.meta as meta
    monkeypatch.setattr(meta, "CHUNK_ELEMS", 7)        # many row chunks per tensor
    cfg = CFG
    whole, lazy = Llama(cfg, seed=3), Llama(cfg, seed=3, device="meta")
    assert all(meta.is_meta(p.data) for p in lazy.parameters())
    lazy.materialize()
    for (n, a), (_, b) in zip(whole.named_parameters(), lazy.named_parameters()):
        assert np.array_equal(a.data, b.data), n
        np.testing.assert_array_equal(a.data, llama_init(cfg, n, 3))
    w = llama_init(cfg, "model.layers.1.mlp.up_proj.weight", 3)       # N(0, 0.02^2), its own stream
    assert w.shape == (24, 16) and 0.015 < w.std() < 0.025
    assert not np.array_equal(w, llama_init(cfg, "model.layers.0.mlp.up_proj.weight", 3))
    assert np.all(llama_init(cfg, "model.norm.weight", 3) == 1)
    x, y = batch(4)
    np.testing.assert_allclose(Llama(cfg, seed=3)(x, y)[1].item(), lazy(x, y)[1].item(), rtol=1e-15)


def test_an_index_without_model_type_is_gpt2(tmp_path):
    from pdist.checkpoint.format import model_type_of
    assert model_type_of({"config": {"n_embd": 64}}) == "gpt2"
    assert model_type_of({"config": {}, "model_type": "llama"}) == "llama"
    assert model_type_of({"config": None}) is None


@pytest.mark.parametrize("kw,words", [
    (dict(n_head=4, n_kv_head=3), "n_head = 4 must be a multiple of n_kv_head = 3"),
    (dict(n_embd=30, n_head=4), "n_embd = 30 must be divisible by n_head = 4"),
    (dict(n_embd=12, n_head=4, n_kv_head=1), "head_dim = n_embd / n_head = 3 must be even"),
    (dict(dropout=0.1), "dropout must be 0.0"),
    (dict(dtype="float16"), "dtype must be 'float32' or 'float64'"),
    (dict(recompute="some"), "recompute must be one of"),
    (dict(n_layer=0), "n_layer must be >= 1"),
    (dict(rope_theta=0.0), "rope_theta (0.0) must be > 0")])
def test_bad_llama_configs_are_refused(kw, words):
    with pytest.raises(ValueError, match="LlamaConfig: .*" + re.escape(words)):
        LlamaConfig(**kw)
    with pytest.raises(ValueError, match="Llama device must be None or 'meta'"):
        Llama(LlamaConfig(), device="cuda")


def _train(cfg, steps=3):
    model = Llama(cfg, seed=1)
    opt = lesson.make_adamw(model.parameters())
    grads = []
    for step in range(steps):
        x, y = batch(10 + step)
        model.zero_grad()
        model(x, y)[1].backward()
        grads.append({n: p.grad.copy() for n, p in model.named_parameters()})
        opt.step()
    return grads, model.state_dict()


def test_recompute_modes_are_bit_equal():
    ref = _train(CFG)
    for mode in ("selective", "full"):
        grads, sd = _train(dataclasses.replace(CFG, recompute=mode))
        for g, rg in zip(grads, ref[0]):
            assert all(np.array_equal(g[n], rg[n]) for n in rg), mode
        assert all(np.array_equal(sd[n], ref[1][n]) for n in sd), mode


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_like_fp32(precision):
    """bf16/fp16 weights with fp32 masters (pdist/engine/precision.py): every Linear rounds its
    input (out_in layout), the RMSNorms run on upcast weights; the losses follow fp32's."""
    cfg = dataclasses.replace(CFG, vocab_size=96, dtype="float32", block_size=16)   # the lessons' corpus
    full, _ = lesson.train_reference(cfg, 0, 4, 8, precision="fp32")
    low, sd = lesson.train_reference(cfg, 0, 4, 8, precision=precision)
    assert all(v.dtype == np.float32 for v in sd.values()) and sorted(sd) == sorted(cfg.param_shapes())
    np.testing.assert_allclose(low, full, rtol=2e-2)
    assert low != full


def test_a_checkpoint_without_model_type_is_gpt2(tmp_path):
    """An index written before pdist had Llama has no model_type: it loads and consolidates as GPT-2."""
    model = Local(GPT(GPTConfig(dtype="float64"), seed=2))
    checkpoint.save(model, None, str(tmp_path / "ckpt"), step=3)
    path = tmp_path / "ckpt" / "index.json"
    index = json.loads(path.read_text())
    assert index["model_type"] == "gpt2" and "model_type" not in index["config"]
    del index["model_type"]
    path.write_text(json.dumps(index))
    again = Local(GPT(GPTConfig(dtype="float64"), seed=5))
    assert checkpoint.load(again, None, str(tmp_path / "ckpt"))[0] == 3
    assert all(np.array_equal(a.data, b.data) for a, b in zip(model.parameters(), again.parameters()))
    out = checkpoint.consolidate(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert json.loads(open(os.path.join(out, "config.json")).read())["model_type"] == "gpt2"
    with pytest.raises(checkpoint.CheckpointError, match="model_type: checkpoint 'gpt2' vs model 'llama'"):
        checkpoint.load(Local(Llama(CFG)), None, str(tmp_path / "ckpt"))


def test_load_state_dict_ignores_rotary_buffers_and_names_problems():
    src, dst = Llama(CFG, seed=1), Llama(CFG, seed=2)
    sd = dict(src.state_dict(), **{"model.rotary_emb.inv_freq": np.ones(2),          # HF's buffers
                                   "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2)})
    dst.load_state_dict(sd)
    assert all(np.array_equal(a.data, b.data) for a, b in zip(src.parameters(), dst.parameters()))
    with pytest.raises(KeyError, match=r"unexpected keys: \['model.extra'\]"):
        dst.load_state_dict(dict(sd, **{"model.extra": np.ones(1)}))
    rows = dst.init_rows("model.layers.1.self_attn.k_proj.weight", 3, 5)    # rows of the init, as a stream
    np.testing.assert_array_equal(rows, llama_init(CFG, "model.layers.1.self_attn.k_proj.weight", 2)[3:5])
