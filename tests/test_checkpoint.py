"""Checkpoints that load under any layout (issue 12; pdist/checkpoint/sharded.py).

One training run at dp 2 x tp 2 ZeRO-1 (4 ranks) saves after every step (keep=3); fresh
models under other layouts and world sizes (4, 2, 1 ranks) load step 2 and train to
step 4 (tests/workers/ckpt_resume.py). The transfer itself must be exact (a reloaded
model saves the same bytes); resuming on the same layout must equal straight training
bit for bit, on another layout to 1e-12 of each tensor's largest element (float64;
1e-13 does not hold: the layouts sum in other orders). Bad checkpoints raise one
CheckpointError on every rank before anything is touched; a rank killed mid-save
leaves the previous checkpoint whole. Hugging Face GPT-2 in and out, and the CLI."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pdist.checkpoint import consolidate, from_pretrained, latest
from pdist.checkpoint.format import CheckpointError, read_tensors, verify
from pdist.testing import launch, mpirun, reports

W = "tests/workers/ckpt_resume.py"
SAVED_AT = "dp=2,tp=2,zero=1"
HSDP = "rep=2,shard=2,zero=3"          # dp_replicate 2 x dp_shard 2: replicas hold the same shards
RESUME = {4: [SAVED_AT, "dp=4,zero=3", "pp=2,dp=2,mb=2", "pp=2,dp=2,zero=1,mb=2", HSDP],
          2: ["tp=2,sp=1", "dp=2,zero=2"], 1: ["local"]}


def tag(spec):
    return spec.replace(",", "_").replace("=", "")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt"))
    mpirun(4, W, "save", d, "--layout", SAVED_AT, timeout=120)
    done = {}

    def resumed(n):
        if n not in done:
            out = mpirun(n, W, "resume", d, *sum((["--layout", s] for s in RESUME[n]), []), timeout=120)
            done[n] = reports(out)
        return done[n]
    return d, resumed


def test_save_writes_an_index_and_keeps_the_last_three(run):
    d, _ = run
    assert sorted(n for n in os.listdir(d) if n.startswith("step-")) == ["step-000002", "step-000003",
                                                                         "step-000004"]
    assert latest(d) == os.path.join(d, "step-000004")
    index = verify(os.path.join(d, "step-000004"))
    assert index["step"] == 4 and index["adam_step"] == 4 and index["extra"] == {"seed": 3, "data_step": 4}
    assert index["layout"]["mesh"] == {"dp": 2, "tp": 2, "pp": 1}
    assert [c["strategy"] for c in index["layout"]["chain"]] == ["ZeRO", "TensorParallel", "Local"]
    assert index["config"]["n_embd"] == 32
    assert sorted(index["files"]) == [f"rank-0000{r}.safetensors" for r in range(4)]
    for name, t in index["tensors"].items():    # replicas written once, no padding: the boxes tile the tensor
        assert sum(int(np.prod(s["shape"])) for s in t["slices"]) == int(np.prod(t["shape"])), name
    assert len([k for k in index["tensors"] if not k.startswith("optimizer.")]) == 28


@pytest.mark.parametrize("n,spec", [(n, s) for n, specs in RESUME.items() for s in specs])
def test_resume_under_any_layout(run, n, spec):
    d, resumed = run
    got = [r for r in resumed(n) if r["layout"] == spec]
    assert len(got) == n and all(r["step"] == 2 and r["extra"] == {"seed": 3, "data_step": 2} for r in got)
    src = read_tensors(os.path.join(d, "step-000002"))
    again = read_tensors(os.path.join(d, f"reloaded-{tag(spec)}"))
    assert sorted(src) == sorted(again) and len(src) == 84
    for k in src:                               # load -> save under another layout: the same numbers
        assert np.array_equal(src[k], again[k]), k
    straight = read_tensors(os.path.join(d, "step-000004"))
    res = read_tensors(os.path.join(d, f"resumed-{tag(spec)}"))
    for k in straight:
        if spec == SAVED_AT:
            assert np.array_equal(res[k], straight[k]), k          # same layout: bit for bit
        else:
            scale = float(np.max(np.abs(straight[k])))
            np.testing.assert_allclose(res[k], straight[k], rtol=1e-12, atol=1e-12 * scale, err_msg=k)


def test_hsdp_saves_each_piece_once_and_loads_under_another_layout(run, tmp_path):
    """Saved under HSDP (the reloaded step 2, written from dp_replicate 2 x dp_shard 2, ZeRO-3): each
    piece once (replicas hold the same shard; the boxes tile every tensor), and loaded back under
    tp 2 on 2 ranks it saves the same numbers again."""
    d, resumed = run
    resumed(4)
    saved = os.path.join(d, f"reloaded-{tag(HSDP)}")
    index = verify(saved)
    assert index["layout"]["mesh"] == {"dp": 4, "tp": 1, "pp": 1, "dp_replicate": 2, "dp_shard": 2}, index["layout"]
    assert [c["strategy"] for c in index["layout"]["chain"]] == ["HSDP", "Local"]
    for name, t in index["tensors"].items():
        assert sum(int(np.prod(s["shape"])) for s in t["slices"]) == int(np.prod(t["shape"])), name
    back = str(tmp_path / "back")
    mpirun(2, W, "transfer", "--copy", "tp=2", saved, back, timeout=120)
    src, again = read_tensors(os.path.join(d, "step-000002")), read_tensors(back)
    assert sorted(src) == sorted(again)
    for k in src:
        assert np.array_equal(src[k], again[k]), k


def test_a_plain_model_saves_and_loads_as_one_process(tmp_path):
    """``checkpoint.save(GPT(...), opt, ...)`` and ``load`` take the plain model as one process:
    its save (trained 2 steps by hand) loads into tp 2 and back bit for bit, and a save of
    dp 2 x ZeRO-2 (4 steps) loads into a plain model, which saves the same bytes."""
    d = {k: str(tmp_path / k) for k in ("plain", "tp2", "back", "z2", "z2-plain")}
    mpirun(1, W, "plain", d["plain"], timeout=120)
    mpirun(2, W, "transfer", "--copy", "tp=2", d["plain"], d["tp2"], timeout=120)
    mpirun(2, W, "save", d["z2"], "--layout", "dp=2,zero=2", timeout=120)
    z2 = os.path.join(d["z2"], "step-000004")
    mpirun(1, W, "transfer", "--copy", "plain", d["tp2"], d["back"], "--copy", "plain", z2, d["z2-plain"],
           timeout=120)
    index = verify(d["plain"])
    assert [c["strategy"] for c in index["layout"]["chain"]] == ["Local"] and index["layout"]["world_size"] == 1
    assert index["adam_step"] == 2 and verify(d["tp2"])["layout"]["world_size"] == 2
    for a, b in (("plain", "tp2"), ("plain", "back"), ("z2-plain", z2)):
        ta, tb = read_tensors(d[a]), read_tensors(d.get(b, b))
        assert sorted(ta) == sorted(tb) and len(ta) == 84, (a, b)
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), (a, b, k)


def _corrupt(src, root):
    """Copies of a good checkpoint, each broken one way: {case: directory}."""
    cases = {}

    def copy(case):
        cases[case] = os.path.join(root, case)
        shutil.copytree(src, cases[case])
        return cases[case]
    with open(os.path.join(copy("truncated"), "rank-00001.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    with open(os.path.join(copy("flipped"), "rank-00002.safetensors"), "r+b") as f:
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([b[0] ^ 0x10]))
    os.remove(os.path.join(copy("missing"), "rank-00003.safetensors"))
    for case, edit in (("config", lambda i: i["config"].update(n_embd=64)),
                       ("version", lambda i: i.update(version=99))):
        p = os.path.join(copy(case), "index.json")
        index = json.load(open(p))
        edit(index)
        json.dump(index, open(p, "w"))
    os.makedirs(os.path.join(root, "notckpt"))
    open(os.path.join(root, "notckpt", "README.txt"), "w").write("hello\n")
    cases["notckpt"] = os.path.join(root, "notckpt")
    return cases


EXPECT = {"truncated": ("rank-00001.safetensors", "truncated"),
          "flipped": ("rank-00002.safetensors", "sha256 mismatch"),
          "missing": ("rank-00003.safetensors", "missing rank file"),
          "config": ("index.json", "n_embd: checkpoint 64 vs model 32"),
          "version": ("index.json", "unknown format version 99"),
          "notckpt": ("notckpt", "not a pdist checkpoint")}


def test_bad_checkpoints_raise_the_same_error_on_every_rank_and_touch_nothing(run, tmp_path):
    d, _ = run
    cases = _corrupt(os.path.join(d, "step-000002"), str(tmp_path))
    good = os.path.join(d, "step-000003")
    got = reports(mpirun(2, "tests/workers/ckpt_errors.py", *cases.values(), good, timeout=120))
    for case, path in cases.items():
        mine = [r for r in got if r["dir"] == path]
        assert len(mine) == 2 and mine[0]["error"] == mine[1]["error"], mine       # the same on every rank
        where, what = EXPECT[case]
        assert where in mine[0]["error"] and what in mine[0]["error"], (case, mine[0]["error"])
        assert all(r["untouched"] for r in mine), (case, mine)
        if case != "config":                  # verify alone cannot know the model
            with pytest.raises(CheckpointError, match=what):
                verify(path)
    ok = [r for r in got if r["dir"] == good]
    assert len(ok) == 2 and all(r["error"] is None and r["step"] == 3 and not r["untouched"] for r in ok), ok


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    d = str(tmp_path / "ckpt")
    run = launch(2, "tests/workers/ckpt_crash.py", d, timeout=120, wrap=False)
    assert run.rc not in (0, None), run.out
    assert sum(1 for r in reports(run.out) if r.get("saved") == 1) == 2, run.out
    assert not any(r.get("saved") == 2 for r in reports(run.out)), run.out
    index = verify(d)                                      # still whole, still step 1
    assert index["step"] == 1 and index["adam_step"] == 1
    assert len(read_tensors(d)) == 84
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert all(n.startswith(".ckpt.pdist-") for n in leftovers), leftovers     # named as pdist's (owner.py)
    for n in leftovers:
        if os.path.isdir(os.path.join(tmp_path, n)):        # never a half checkpoint that looks whole
            with pytest.raises(CheckpointError, match="not a pdist checkpoint"):
                verify(os.path.join(tmp_path, n))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "pdist.checkpoint", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_verify_inspect_consolidate(run, tmp_path):
    d, _ = run
    good = os.path.join(d, "step-000004")
    r = cli("verify", good)
    assert r.returncode == 0 and r.stdout.startswith("OK") and "checksums match" in r.stdout, r
    bad = _corrupt(good, str(tmp_path))
    for case in ("flipped", "missing", "notckpt"):
        r = cli("verify", bad[case])
        assert r.returncode == 1 and EXPECT[case][1] in r.stderr, (case, r)
    r = cli("inspect", good)
    assert r.returncode == 0 and "step 4" in r.stdout and "mesh {'dp': 2, 'tp': 2, 'pp': 1}" in r.stdout, r
    assert "optimizer.exp_avg_sq.transformer.h.1.mlp.c_fc.weight" in r.stdout and "(32, 128)" in r.stdout, r
    r = cli("consolidate", good, str(tmp_path / "hf"))
    assert r.returncode == 0, r
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    full = read_tensors(good)
    back = from_pretrained(str(tmp_path / "hf")).state_dict()
    assert sorted(back) == sorted(k for k in full if not k.startswith("optimizer."))
    assert all(np.array_equal(back[k], full[k]) for k in back)


def _hf():
    """torch and transformers, or a skip (they are optional: not installed, or failing to import)."""
    try:
        import torch
        import transformers
    except Exception as e:          # noqa: BLE001 - a broken install skips too
        pytest.skip(f"torch/transformers not importable: {e}")
    return torch, transformers


def _logits(model, idx):
    from pdist.engine.autograd import no_grad
    with no_grad():
        return np.asarray(model(idx).data)


def test_consolidated_checkpoint_loads_in_transformers(run, tmp_path):
    torch, transformers = _hf()
    d, _ = run
    out = consolidate(os.path.join(d, "step-000004"), str(tmp_path / "hf"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float64).eval()
    ours = from_pretrained(out)
    idx = np.random.default_rng(0).integers(0, 96, (2, 8))
    with torch.no_grad():
        want = hf(torch.tensor(idx)).logits.numpy()
    np.testing.assert_allclose(_logits(ours, idx), want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_from_pretrained_reads_save_pretrained(tmp_path):
    torch, transformers = _hf()
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).to(torch.float64).eval()
    hf.save_pretrained(str(tmp_path))
    ours = from_pretrained(str(tmp_path))
    assert ours.config.dtype == "float64" and ours.config.block_size == 16
    idx = np.random.default_rng(1).integers(0, 50, (2, 16))
    with torch.no_grad():
        want = hf(torch.tensor(idx)).logits.numpy()
    np.testing.assert_allclose(_logits(ours, idx), want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_mixed_precision_checkpoint_loads_under_another_layout(tmp_path):
    """bf16/fp16 saved under ZeRO-3 at dp 2 (tests/workers/ckpt_precision.py), loaded into
    tp 2 and one process: the files hold fp32 masters, m and v, which come back bit for bit
    (saved again, the same numbers); the low-precision weights are round(masters); fp16's
    scaler comes back. A float64 fp32 checkpoint loads into bf16: masters = fp32(saved)."""
    got = reports(mpirun(2, "tests/workers/ckpt_precision.py", tmp_path, timeout=120))
    assert len(got) == 2 * 2 * 2 + 1
    for r in got:
        assert r["gap"] == 0.0, r                      # w = round(W) after the load
        assert r["scaler"] == r["saved_scaler"], r
        if r["prec"] == "fp16":
            assert r["scaler"]["_growth_tracker"] == 2, r    # a fresh scaler's is 0
    for prec in ("bf16", "fp16"):
        src = read_tensors(tmp_path / prec)
        index = verify(tmp_path / prec)
        assert {t["dtype"] for t in index["tensors"].values()} == {"float32"}
        assert (index["scaler"] is None) == (prec == "bf16")
        assert len(src) == 3 * 28                       # masters, m, v
        for layout in ("tp2", "local"):
            again = read_tensors(tmp_path / f"{prec}-{layout}")
            assert sorted(again) == sorted(src)
            for k in src:
                assert again[k].dtype == np.float32 and np.array_equal(again[k], src[k]), (prec, layout, k)
    old, bf = read_tensors(tmp_path / "fp32"), read_tensors(tmp_path / "fp32-bf16")
    assert sorted(old) == sorted(bf) and all(old[k].dtype == np.float64 for k in old)
    for k in old:
        assert np.array_equal(bf[k], old[k].astype(np.float32)), k
