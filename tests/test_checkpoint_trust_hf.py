"""``from_pretrained`` reads a Hugging Face directory as if a stranger wrote it (issue 30,
Build 2; pdist/checkpoint/hf.py, docs/checkpoint.md "Trust model"): config.json's types and
ranges and the weights' shapes and dtypes are checked before any model is built (a
monkeypatched ``registry.build`` fails the test if it is reached), non-finite weights are an
error or a warning. The directories are written by ``consolidate`` (no torch needed)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pdist import checkpoint
from pdist.checkpoint import CheckpointError
from pdist.models.gpt import GPT, GPTConfig
from pdist.optim import AdamW
from pdist.parallel import Local

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8, dtype="float64")
WTE = "transformer.wte.weight"


@pytest.fixture
def good(tmp_path):
    model = Local(GPT(CFG, 0))
    opt = AdamW(model.parameters())
    x = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, CFG.block_size))
    model.forward_backward(x, np.roll(x, 1, axis=1))
    opt.step()
    d = str(tmp_path / "ckpt")
    checkpoint.save(model, opt, d, step=1)
    return d


@pytest.fixture
def hf_dir(good, tmp_path):
    return checkpoint.consolidate(good, str(tmp_path / "hf"))


def edit_config(out, **kw):
    p = os.path.join(out, "config.json")
    cfg = json.load(open(p))
    cfg.update(kw)
    json.dump(cfg, open(p, "w"))


def edit_weights(out, fn):
    from safetensors.numpy import load_file, save_file
    p = os.path.join(out, "model.safetensors")
    sd = load_file(p)
    fn(sd)
    save_file(sd, p, metadata={"format": "pt"})


def no_build(monkeypatch):
    """from_pretrained must refuse before it builds a model."""
    from pdist.models import registry

    def build(*a, **k):
        raise AssertionError("from_pretrained built the model before checking its config and weights")
    monkeypatch.setattr(registry, "build", build)


FAST = """import json, sys, time
from pdist import checkpoint
t = time.perf_counter()
try:
    checkpoint.from_pretrained(sys.argv[1]); err = None
except checkpoint.CheckpointError as e:
    err = str(e)
print(json.dumps([err, time.perf_counter() - t]))
"""


def test_an_absurd_n_layer_fails_in_under_a_second(hf_dir):
    edit_config(hf_dir, n_layer=10 ** 9)
    r = subprocess.run([sys.executable, "-c", FAST, hf_dir], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    err, secs = json.loads(r.stdout.strip().splitlines()[-1])
    assert err is not None and "n_layer = 1000000000 (an integer from 1 to 1,024)" in err and secs < 1.0, (err, secs)


def test_config_types_and_ranges_are_checked_before_building(hf_dir, monkeypatch):
    no_build(monkeypatch)
    for kw, want in (({"n_embd": "8"}, "n_embd = '8'"), ({"n_head": 0}, "n_head = 0"),
                     ({"n_head": 3}, "divisible by n_head=3"), ({"vocab_size": True}, "vocab_size = True"),
                     ({"layer_norm_epsilon": -1}, "layer_norm_epsilon = -1")):
        edit_config(hf_dir, **{"n_embd": 8, "n_head": 2, "vocab_size": 16, "layer_norm_epsilon": 1e-5, **kw})
        with pytest.raises(CheckpointError, match="config.json") as e:
            checkpoint.from_pretrained(hf_dir)
        assert want in str(e.value), (kw, e.value)


def test_config_and_weights_shapes_must_agree_before_building(hf_dir, monkeypatch):
    no_build(monkeypatch)
    edit_config(hf_dir, n_embd=16)
    with pytest.raises(CheckpointError, match=r"the weights do not match config.json: "
                       r"transformer.wte.weight: file \[16, 8\] vs config \[16, 16\]"):
        checkpoint.from_pretrained(hf_dir)
    edit_config(hf_dir, n_embd=8, n_layer=2)
    with pytest.raises(CheckpointError, match=r"missing \['transformer.h.1.ln_1.weight'"):
        checkpoint.from_pretrained(hf_dir)


def test_nan_weights_are_an_error_or_a_warning(hf_dir):
    edit_weights(hf_dir, lambda sd: sd["transformer.h.0.attn.c_proj.weight"].__setitem__((0, 1), np.nan))
    with pytest.raises(CheckpointError, match=r"non-finite weights .* transformer.h.0.attn.c_proj.weight \(1 of 64\)"):
        checkpoint.from_pretrained(hf_dir)
    with pytest.warns(RuntimeWarning, match="non-finite weights"):
        m = checkpoint.from_pretrained(hf_dir, allow_nonfinite=True)
    assert np.isnan(m.state_dict()["transformer.h.0.attn.c_proj.weight"][0, 1])


def test_integer_weights_are_refused(hf_dir, monkeypatch):
    no_build(monkeypatch)
    edit_weights(hf_dir, lambda sd: sd.update({WTE: (sd[WTE] * 100).astype(np.int8)}))
    with pytest.raises(CheckpointError, match=f"{WTE}: int8 \\(want float16, float32 or float64\\)"):
        checkpoint.from_pretrained(hf_dir)


def test_the_good_hf_directory_loads(hf_dir, good):
    back = checkpoint.from_pretrained(hf_dir).state_dict()
    full = checkpoint.format.read_tensors(good)
    assert sorted(back) == sorted(CFG.param_shapes()) and all(np.array_equal(back[k], full[k]) for k in back)


def test_hf_links_are_followed_to_regular_files_only(hf_dir, tmp_path):
    """Hugging Face's cache links each file to a blob: that loads; a FIFO config.json is refused, unblocked."""
    blob = str(tmp_path / "blob")
    shutil.move(os.path.join(hf_dir, "model.safetensors"), blob)
    os.symlink(blob, os.path.join(hf_dir, "model.safetensors"))
    assert sorted(checkpoint.from_pretrained(hf_dir).state_dict()) == sorted(CFG.param_shapes())
    os.remove(os.path.join(hf_dir, "config.json"))
    os.mkfifo(os.path.join(hf_dir, "config.json"))
    r = subprocess.run([sys.executable, "-c", FAST, hf_dir], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    err, _ = json.loads(r.stdout.strip().splitlines()[-1])
    assert err is not None and "the config is a FIFO, not a regular file" in err, err
