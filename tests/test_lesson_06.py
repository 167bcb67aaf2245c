"""lessons/06_mesh.py: 3-D parallelism passes at 8 ranks (dp 2 x tp 2 x pp 2, GPT-2 and Llama) and at 4 ranks
with each pair of strategies, writes the JSON contract, and a bad layout stops every
rank with exit code 2 before any collective."""
import json
import os

import pytest

from pdist.testing import launch, mpirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L06 = os.path.join(ROOT, "lessons", "06_mesh.py")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_lesson_06_at_8_ranks_json(tmp_path, model):
    path = tmp_path / "mesh.json"
    out = mpirun(8, L06, "--steps", "3", "--json", path, "--model", model, timeout=300)
    assert f"{model} Ψ = " in out, out
    assert "PASS: 06_mesh (dp 2 x tp 2 x pp 2, ZeRO-1, SP" in out, out
    s = json.loads(path.read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("06_mesh", 8, "PASS")
    (r,) = s["runs"]
    assert r["layout"]["dp"] == r["layout"]["tp"] == r["layout"]["pp"] == 2 and r["layout"]["zero_stage"] == 1
    assert r["loss"] == pytest.approx(r["baseline_loss"], rel=1e-9)
    assert [m["rank"] for m in r["memory_per_rank"]] == list(range(8))
    for m in r["memory_per_rank"]:
        assert [m["params_bytes"], m["grads_bytes"], m["optim_bytes"]] == m["formula_bytes"]
    for g in r["comm_bytes_per_group"]:
        assert all(g[k] > 0 and abs(g[k] - g["theory"][k]) <= 64 for k in ("dp", "tp", "pp")), g


# one launch per batch (tests/workers/lesson_each.py: the lesson run once per layout), each asserted by name
PAIRS = {"1of2": ["--dp 2 --tp 2", "--tp 2 --pp 2", "--dp 2 --pp 2 --schedule gpipe", "--dp 2 --tp 2 --zero 1 --no-sp"],
         "2of2": ["--dp 4 --zero 3", "--tp 2 --pp 2 --precision bf16", "--model llama --dp 2 --tp 2 --precision bf16"]}


@pytest.mark.parametrize("batch", list(PAIRS))
def test_lesson_06_pairs_at_4_ranks(batch):
    """Each pair composes and equals one process; a small model (the 8-rank tests above run the
    lesson's own sizes): 2 layers (one per stage at pp 2), width 32, T 16, 2 steps."""
    out = mpirun(4, "tests/workers/lesson_each.py", L06, ";".join(PAIRS[batch]), "--steps", "2", "--n-layer", "2",
                 "--n-embd", "32", "--block-size", "16", timeout=300)
    parts = {p.split("\n", 1)[0]: p for p in out.split("=== case ")[1:]}
    for layout in PAIRS[batch]:
        assert "PASS: 06_mesh" in parts.get(layout, ""), (layout, out[-6000:])


@pytest.mark.parametrize("args,words", [
    ("--dp 2 --tp 2 --pp 2", "= 8, but the job has 4 ranks"),
    ("--tp 4 --n-head 6 --n-embd 48", "not divisible: n_head = 6"),
    ("--pp 4 --n-layer 2", "4 (virtual) stages but only 2 layers"),
    ("--dp 2 --tp 2 --batch-size 12", "--batch-size 12 must divide into dp 2 x 4 micro-batches"),
    ("--dp 2 --pp 2 --zero 3", "ZeRO-3 does not compose with pipeline parallelism"),
    ("--tp 4 --model llama", "not divisible: n_kv_head = 2"),
    ("--model llama --n-head 4 --n-kv-head 3", "must be a multiple of n_kv_head = 3"),
])
def test_bad_layout_stops_every_rank(args, words):
    r = launch(4, L06, *args.split(), timeout=120, wrap=False)       # as a user runs it
    assert r.rc == 2, r.out
    assert r.out.count(words) == 4, r.out                # the same message from every rank
    assert "PASS" not in r.out and "FAIL" not in r.out
