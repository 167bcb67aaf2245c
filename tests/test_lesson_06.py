"""lessons/06_mesh.py: 3-D parallelism passes at 8 ranks (dp 2 x tp 2 x pp 2, GPT-2 and Llama) and at 4 ranks
with each pair of strategies, writes the JSON contract, and a bad layout stops every
rank with exit code 2 before any collective.

The lesson runs as jobs of one launch per world size (tests/shared_launch.py, tests/workers/jobs.py:
one start-up per rank for all of them): both models at 8 ranks; every pair and every bad layout at
4 ranks; one bad layout also runs alone, as a user runs it."""
import json
import os
from pathlib import Path

import pytest

from pdist.testing import launch
from shared_launch import own, scratch, stops, world
from shared_launch import text as job_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L06 = os.path.join(ROOT, "lessons", "06_mesh.py")


MODELS = ("gpt2", "llama")


def test_lesson_06_at_8_ranks_json(request):
    """Both models, each writing its own JSON."""
    out = world(8, request)
    for model in MODELS:
        text = job_text(request, out, model)
        assert f"{model} Ψ = " in text, (model, out[-6000:])
        assert "PASS: 06_mesh (dp 2 x tp 2 x pp 2, ZeRO-1, SP" in text, (model, out[-6000:])
        s = json.loads(Path(scratch(f"l06-{model}.json")).read_text())
        assert (s["lesson"], s["world_size"], s["check"]) == ("06_mesh", 8, "PASS"), model
        (r,) = s["runs"]
        assert r["layout"]["dp"] == r["layout"]["tp"] == r["layout"]["pp"] == 2 and r["layout"]["zero_stage"] == 1
        assert r["loss"] == pytest.approx(r["baseline_loss"], rel=1e-9), model
        assert [m["rank"] for m in r["memory_per_rank"]] == list(range(8)), model
        for m in r["memory_per_rank"]:
            assert [m["params_bytes"], m["grads_bytes"], m["optim_bytes"]] == m["formula_bytes"], (model, m)
        for g in r["comm_bytes_per_group"]:
            assert all(g[k] > 0 and abs(g[k] - g["theory"][k]) <= 64 for k in ("dp", "tp", "pp")), (model, g)


# each pair on a small model (the 8-rank test above runs the lesson's own sizes): 2 layers (one per stage
# at pp 2), width 32, T 16, 2 steps
PAIRS = ["--dp 2 --tp 2", "--tp 2 --pp 2", "--dp 2 --pp 2 --schedule gpipe", "--dp 2 --tp 2 --zero 1 --no-sp",
         "--dp 4 --zero 3", "--tp 2 --pp 2 --precision bf16", "--model llama --dp 2 --tp 2 --precision bf16",
         "--dp-replicate 2 --dp-shard 2 --zero 3"]                # HSDP: the shard group's and the replicas' bytes
SMALL = ["--steps", "2", "--n-layer", "2", "--n-embd", "32", "--block-size", "16"]
BAD = [
    ("--dp 2 --tp 2 --pp 2", "= 8, but the job has 4 ranks"),
    ("--tp 4 --n-head 6 --n-embd 48", "not divisible: n_head = 6"),
    ("--pp 4 --n-layer 2", "4 (virtual) stages but only 2 layers"),
    ("--dp 2 --tp 2 --batch-size 12", "--batch-size 12 must divide into dp 2 x 4 micro-batches"),
    ("--dp 2 --pp 2 --zero 3", "ZeRO-3 does not compose with pipeline parallelism"),
    ("--tp 4 --model llama", "not divisible: n_kv_head = 2"),
    ("--model llama --n-head 4 --n-kv-head 3", "must be a multiple of n_kv_head = 3"),
    ("--dp 4 --dp-shard 3", "dp must equal dp_replicate * dp_shard"),
]


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py): at 8 both models;
    at 4 the bad layouts first (each stops before any collective, its output captured), then the
    pairs, of this session's tests."""
    if n == 8:
        return {m: [L06, "--steps", "3", "--json", scratch(f"l06-{m}.json"), "--model", m] for m in MODELS
                if "test_lesson_06_at_8_ranks_json" in names}
    spec = {f"bad {a}": stops(L06, *a.split()) for a, w in BAD
            if f"test_bad_layout_stops_every_rank[{a}-{w}]" in names}
    spec |= {p: [L06, *SMALL, *p.split()] for p in PAIRS if f"test_lesson_06_pairs_at_4_ranks[{p}]" in names}
    return spec if n == 4 else {}


@pytest.mark.parametrize("layout", PAIRS)
def test_lesson_06_pairs_at_4_ranks(layout, request):
    """The pair composes and equals one process."""
    out = world(4, request)
    text = job_text(request, out, layout)
    assert "PASS: 06_mesh" in text, (layout, out[-6000:])
    if "--dp-shard" in layout:             # built as HSDP, its replicas' bytes in their own column
        assert "HSDP-3" in text and "dp_rep sent" in text, text


@pytest.mark.parametrize("args,words", BAD)
def test_bad_layout_stops_every_rank(args, words, request):
    """Every rank exits with code 2 and the same message, having printed no verdict."""
    got = own(request, world(4, request), f"bad {args}")
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3], got
    for r in got:
        assert r["code"] == 2 and words in r["out"], r
        assert "PASS" not in r["out"] and "FAIL" not in r["out"], r


def test_a_bad_layout_exits_2_as_a_user_runs_it():
    """``mpiexec -n 4 python lessons/06_mesh.py`` with a bad layout (no harness): exit code 2."""
    args, words = BAD[0]
    r = launch(4, L06, *args.split(), timeout=120, wrap=False)
    assert r.rc == 2, r.out
    assert r.out.count(words) == 4, r.out                # the same message from every rank
    assert "PASS" not in r.out and "FAIL" not in r.out
