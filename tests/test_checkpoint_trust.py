"""A checkpoint read as if a stranger wrote it (issue 30, Build 2; pdist/checkpoint/trust.py,
validate.py, docs/checkpoint.md "Trust model").

Each test breaks a small good checkpoint one way and asks ``verify`` and ``load`` for their
verdict: both must raise one CheckpointError naming the problem (the same message: they run
one ``validate``), and ``load`` must leave the model and optimizer untouched. FIFOs and
device files run in a subprocess with a timeout, so a regression shows as a failure, not a
hang. from_pretrained's checks: tests/test_checkpoint_trust_hf.py."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pdist import checkpoint
from pdist.checkpoint import CheckpointError
from pdist.checkpoint.format import write_safetensors
from pdist.models.gpt import GPT, GPTConfig
from pdist.optim import AdamW
from pdist.parallel import Local

CFG = GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8, dtype="float64")
WTE = "transformer.wte.weight"                 # (16, 8): split into boxes by the tests


def trained(seed=0, cfg=CFG):
    model = Local(GPT(cfg, seed))
    opt = AdamW(model.parameters())
    x = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, cfg.block_size))
    model.forward_backward(x, np.roll(x, 1, axis=1))
    opt.step()
    return model, opt


@pytest.fixture
def good(tmp_path):
    d = str(tmp_path / "ckpt")
    checkpoint.save(*trained(), d, step=1)
    return d


def edit_index(d, fn):
    p = os.path.join(d, "index.json")
    index = json.load(open(p))
    fn(index)
    with open(p, "w") as f:
        json.dump(index, f)
    return index


def rewrite_boxes(d, name, boxes, file="rank-00001.safetensors", values=None):
    """Save ``name`` again as ``boxes`` [(offsets, shape)] in a new listed rank file (sized
    and hashed as save would): a valid checkpoint, unless the boxes themselves are wrong.
    ``values``: one array per box to write instead of the tensor's own elements."""
    full = checkpoint.format.read_tensors(d)[name]
    arrays = {}
    for i, (o, n) in enumerate(boxes):
        part = full[tuple(slice(a, a + k) for a, k in zip(o, n))] if values is None else values[i]
        arrays[f"{name}@{','.join(map(str, o))}"] = np.ascontiguousarray(part)
    size, digest = write_safetensors(os.path.join(d, file), arrays)

    def fn(index):
        index["files"][file] = {"bytes": size, "sha256": digest}
        index["tensors"][name]["slices"] = [{"file": file, "key": k, "offsets": list(o), "shape": list(n)}
                                            for k, (o, n) in zip(arrays, boxes)]
    return edit_index(d, fn)


def snapshot(model):
    return [np.array(p.data) for p in model.parameters()]


def verdicts(d, **kw):
    """(verify's error, load's error) as strings (None: it passed); load must touch nothing."""
    out = []
    try:
        checkpoint.verify(d)
        out.append(None)
    except CheckpointError as e:
        out.append(str(e))
    model, opt = trained(seed=7)
    before, state = snapshot(model), {k: dict(v) for k, v in opt.state.items()}
    try:
        checkpoint.load(model, opt, d, **kw)
        out.append(None)
    except CheckpointError as e:
        out.append(str(e))
        assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(model))), "load touched the model"
        assert all(np.array_equal(opt.state[k]["exp_avg"], v["exp_avg"]) and opt.state[k]["step"] == v["step"]
                   for k, v in state.items()), "load touched the optimizer"
    return out


def refused(d, pattern, **kw):
    v, ld = verdicts(d, **kw)
    assert v is not None and ld is not None, (v, ld)
    assert v == ld, (v, ld)                        # one validate: the same message
    assert pattern in v, v
    return v


def test_the_good_checkpoint_and_a_valid_split_pass(good):
    assert verdicts(good) == [None, None]
    rewrite_boxes(good, WTE, [((0, 0), (16, 3)), ((0, 3), (9, 5)), ((9, 3), (7, 5))])
    assert verdicts(good) == [None, None]         # three boxes tiling the tensor: fine
    model = Local(GPT(CFG, 9))
    checkpoint.load(model, None, good)
    assert np.array_equal(model.module.state_dict()[WTE], checkpoint.format.read_tensors(good)[WTE])


@pytest.mark.parametrize("how", ["parent", "absolute"])
def test_a_name_outside_the_directory_is_refused(good, tmp_path, how):
    outside = str(tmp_path / "outside.safetensors")
    shutil.copy(os.path.join(good, "rank-00000.safetensors"), outside)
    name = "../outside.safetensors" if how == "parent" else outside

    def fn(index):
        index["files"][name] = index["files"].pop("rank-00000.safetensors")
        for t in index["tensors"].values():
            for s in t["slices"]:
                s["file"] = name
    edit_index(good, fn)
    os.remove(os.path.join(good, "rank-00000.safetensors"))
    refused(good, "is not a plain file name inside the directory")


def test_a_symlink_out_is_refused(good, tmp_path):
    rank = os.path.join(good, "rank-00000.safetensors")
    shutil.move(rank, str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), rank)
    refused(good, "is a symbolic link")


def test_a_slice_in_an_unlisted_file_is_refused(good):
    shutil.copy(os.path.join(good, "rank-00000.safetensors"), os.path.join(good, "rank-00009.safetensors"))
    edit_index(good, lambda i: i["tensors"][WTE]["slices"][0].update(file="rank-00009.safetensors"))
    refused(good, "which 'files' does not list")


def test_swapped_boxes_are_refused(good):
    rewrite_boxes(good, WTE, [((0, 0), (8, 8)), ((8, 0), (8, 8))])
    edit_index(good, lambda i: [s.update(offsets=[8 - s["offsets"][0], 0]) for s in i["tensors"][WTE]["slices"]])
    refused(good, "does not match its offsets [8, 0] (swapped or edited boxes)")


def test_overlapping_boxes_that_differ_are_refused(good):
    full = checkpoint.format.read_tensors(good)[WTE]
    rewrite_boxes(good, WTE, [((0, 0), (10, 8)), ((8, 0), (8, 8))], values=[full[:10], full[8:] + 1.0])
    refused(good, "overlap on [[8, 0], [10, 8]) and differ there")


def test_overlapping_replicas_that_agree_load(good):
    rewrite_boxes(good, WTE, [((0, 0), (10, 8)), ((8, 0), (8, 8))])   # pipeline's tied wte does this
    assert verdicts(good) == [None, None]


def test_a_box_outside_the_tensor_is_refused(good):
    rewrite_boxes(good, WTE, [((0, 0), (8, 8)), ((8, 0), (9, 8))],
                  values=[np.zeros((8, 8)), np.zeros((9, 8))])
    edit_index(good, lambda i: i["tensors"][WTE]["slices"][1].update(key=f"{WTE}@8,0"))
    refused(good, "lies outside the tensor's shape [16, 8]")


def test_a_file_dtype_other_than_the_index_is_refused(good):
    full = checkpoint.format.read_tensors(good)[WTE]
    index = rewrite_boxes(good, WTE, [((0, 0), (16, 8))], values=[full.astype(np.float32)])
    assert index["tensors"][WTE]["dtype"] == "float64"
    refused(good, f"'{WTE}@0,0' is float32 [16, 8] in the file, float64 [16, 8] in the index")


def test_an_index_dtype_other_than_the_model_needs_cast(tmp_path):
    """A mixed-precision checkpoint (fp32 masters, config float64) into a float64 model: an
    error naming both dtypes, unless cast=True; a bf16 model takes a float64 one (its masters)."""
    from pdist.engine.precision import cast_module
    from pdist.parallel.mixed_precision import MixedPrecision
    bf = MixedPrecision(Local(cast_module(GPT(CFG, 1), "bf16")), "bf16")
    d = str(tmp_path / "bf16")
    checkpoint.save(bf, None, d, step=0)
    v, ld = verdicts(d)
    assert v is None and "the checkpoint holds float32, the model float64" in ld and "cast=True" in ld, ld
    assert verdicts(d, cast=True) == [None, None]
    f64 = str(tmp_path / "f64")
    checkpoint.save(*trained(), f64, step=1)
    checkpoint.load(MixedPrecision(Local(cast_module(GPT(CFG, 2), "bf16")), "bf16"), None, f64)


def test_a_missing_optimizer_entry_is_refused_before_anything_is_loaded(good):
    last = f"optimizer.exp_avg_sq.{list(CFG.param_shapes())[-1]}"
    edit_index(good, lambda i: i["tensors"].pop(last))
    refused(good, f"the checkpoint holds optimizer state but no {last}")


def test_a_malformed_index_is_one_checkpoint_error(good):
    for edit in (lambda i: i.update(tensors=[]), lambda i: i["files"]["rank-00000.safetensors"].pop("bytes"),
                 lambda i: i["tensors"][WTE].update(shape="16x8"), lambda i: i.update(step="one"),
                 lambda i: i["tensors"][WTE]["slices"][0].update(offsets=[0])):
        d = good + "-bad"
        shutil.copytree(good, d)
        edit_index(d, edit)
        refused(d, "index.json")
        shutil.rmtree(d)


def test_an_index_over_the_size_cap_is_refused_unread(good):
    with open(os.path.join(good, "index.json"), "r+b") as f:
        f.truncate(200 << 20)                         # sparse: costs no disk
    refused(good, "over the 134,217,728-byte limit")


PROBE = """import json, sys
from pdist import checkpoint
from pdist.models.gpt import GPT, GPTConfig
out = []
for fn in (lambda: checkpoint.verify(sys.argv[1]),
           lambda: checkpoint.load(GPT(GPTConfig(**json.loads(sys.argv[2])), 0), None, sys.argv[1])):
    try:
        fn(); out.append(None)
    except checkpoint.CheckpointError as e:
        out.append(str(e))
print(json.dumps(out))
"""


def probe(d):
    """verify and load in a subprocess, 30 s at most: a hang is a failure, not a stuck suite."""
    import dataclasses
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", PROBE, d, json.dumps(dataclasses.asdict(CFG))], capture_output=True,
                       text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("what", ["rank-00000.safetensors", "index.json"])
def test_a_fifo_is_refused_without_blocking(good, what):
    path = os.path.join(good, what)
    os.remove(path)
    os.mkfifo(path)
    if what != "index.json":                      # a FIFO's size is 0: make the index agree
        edit_index(good, lambda i: i["files"][what].update(bytes=0))
    v, ld = probe(good)
    assert v == ld and v is not None and "is a FIFO, not a regular file" in v, (v, ld)


@pytest.mark.parametrize("how", ["link", "node"])
def test_a_device_file_is_refused(good, how):
    """/dev/zero (endless bytes) as a rank file: linked, or (root only) a character device made here."""
    import stat
    path = os.path.join(good, "rank-00000.safetensors")
    os.remove(path)
    if how == "link":
        os.symlink("/dev/zero", path)
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except OSError as e:
            pytest.skip(f"cannot mknod here ({e.strerror}): only root can")
    edit_index(good, lambda i: i["files"]["rank-00000.safetensors"].update(bytes=0))
    v, ld = probe(good)
    want = "symbolic link to '/dev/zero'" if how == "link" else "is a character device, not a regular file"
    assert v == ld and v is not None and want in v, (v, ld)

def test_every_rank_raises_the_same_error_and_touches_nothing(tmp_path):
    """2 ranks load (tests/workers/ckpt_errors.py, dp 2 ZeRO-1): rank r reads the headers of
    files r, r+2, ..., so a wrong dtype in rank-00001 is seen by rank 1 alone and must
    reach rank 0 too; the good checkpoint then loads on both. No process is left behind."""
    from pdist.course import lesson
    from pdist.testing import mpirun, reports
    cfg = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=2, n_head=4, n_embd=32)
    good = str(tmp_path / "good")
    checkpoint.save(*trained(3, cfg), good, step=1)
    full = checkpoint.format.read_tensors(good)[WTE]
    cases = {}
    for case in ("dtype", "swap", "optimizer", "fifo", "outside"):
        cases[case] = str(tmp_path / case)
        shutil.copytree(good, cases[case])
    rewrite_boxes(cases["dtype"], WTE, [((0, 0), (96, 32))], values=[full.astype(np.float32)])
    rewrite_boxes(cases["swap"], WTE, [((0, 0), (48, 32)), ((48, 0), (48, 32))])
    edit_index(cases["swap"], lambda i: [s.update(offsets=[48 - s["offsets"][0], 0]) for s in i["tensors"][WTE]["slices"]])
    edit_index(cases["optimizer"], lambda i: i["tensors"].pop(f"optimizer.exp_avg.{WTE}"))
    rewrite_boxes(cases["fifo"], WTE, [((0, 0), (96, 32))])
    os.remove(os.path.join(cases["fifo"], "rank-00001.safetensors"))
    os.mkfifo(os.path.join(cases["fifo"], "rank-00001.safetensors"))
    edit_index(cases["fifo"], lambda i: i["files"]["rank-00001.safetensors"].update(bytes=0))
    edit_index(cases["outside"], lambda i: i["tensors"][WTE]["slices"][0].update(file="../good/rank-00000.safetensors"))
    want = {"dtype": "is float32 [96, 32] in the file, float64 [96, 32] in the index (found on rank 1",
            "swap": "(swapped or edited boxes)", "optimizer": f"no optimizer.exp_avg.{WTE}",
            "fifo": "is a FIFO, not a regular file", "outside": "is not a plain file name inside the directory"}
    got = reports(mpirun(2, "tests/workers/ckpt_errors.py", *cases.values(), good, timeout=120))
    for case, d in cases.items():
        mine = [r for r in got if r["dir"] == d]
        assert len(mine) == 2 and mine[0]["error"] == mine[1]["error"], (case, mine)
        assert want[case] in mine[0]["error"] and all(r["untouched"] for r in mine), (case, mine)
    ok = [r for r in got if r["dir"] == good]
    assert len(ok) == 2 and all(r["error"] is None and r["step"] == 1 for r in ok), ok
    left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left, left                          # no rank of the run outlives it
