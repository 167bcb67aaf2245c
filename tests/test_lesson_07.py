"""lessons/07_checkpoint.py at 4 ranks: saved under ZeRO-3, the naive dump's failure
shown, loaded into dp 2 x tp 2, ZeRO-1 at dp 2 and one process, each continuation equal
to the uninterrupted run; the JSON summary; and a bad flag stops every rank. Under
--precision bf16/fp16 each continuation equals a one-process reference in the same
precision with the saving layout's dp·m = 4 micro-batches, then the loading layout's:
bit for bit at tp = 1, rtol 1e-6 at tp 2; each file holds 3·4·Ψ_r bytes (fp32 W, m, v)."""
import json
import os
from pathlib import Path

import pytest

from pdist.testing import launch
from shared_launch import chosen, own, scratch, stops, world, text

L07 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons", "07_checkpoint.py")
SMALL = ["--n-embd", "32", "--block-size", "16"]                                                # a small model


def suite_jobs(n, names):
    """This module's jobs in the suite's 4-rank launch (tests/shared_launch.py): the bad flag first (it
    stops every rank before any collective, its output captured), then each run, in its own folder."""
    spec = {"test_lesson_07_needs_4_ranks_and_a_save_step": stops(L07, "--steps", "4", "--save-at", "4"),
            "test_lesson_07_at_4_ranks": [L07, "--steps", "6", "--save-at", "3", "--dir", scratch("l07"),
                                          "--json", scratch("l07.json")]}
    for p in ("bf16", "fp16"):
        spec[f"test_lesson_07_mixed_precision[{p}]"] = [L07, "--steps", "4", "--save-at", "2", "--dir", scratch(f"l07{p}"),
                                                        "--json", scratch(f"l07{p}.json"), "--precision", p, *SMALL]
    return chosen(spec, names) if n == 4 else {}


def test_lesson_07_at_4_ranks(request):
    out = text(request, world(4, request))
    assert "PASS: 07_checkpoint" in out, out
    assert "the dump is tied to the layout that wrote it" in out, out       # the naive dump's failure
    assert os.path.exists(Path(scratch("l07")) / "step-000003" / "index.json")
    s = json.loads(Path(scratch("l07.json")).read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("07_checkpoint", 4, "PASS")
    assert [r["name"] for r in s["runs"]] == ["dp 2 x tp 2", "ZeRO-1, dp 2", "1 process"]
    for r in s["runs"]:
        assert abs(r["loss"] - r["baseline_loss"]) <= 1e-9 * abs(r["baseline_loss"]) and r["rel_err"] < 1e-12


def test_lesson_07_needs_4_ranks_and_a_save_step(request):
    r = launch(2, L07, timeout=60, wrap=False)                               # as a user runs it
    assert r.rc == 2 and r.out.count("run it with mpirun -n 4") == 2, r.out
    got = own(request, world(4, request))                                   # --save-at 4 of 4 steps
    assert sorted(g["rank"] for g in got) == [0, 1, 2, 3], got
    assert all(g["code"] == 2 and g["out"].count("--save-at must be in [1, --steps)") == 1 for g in got), got


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lesson_07_mixed_precision(precision, request):
    out = text(request, world(4, request))
    # PASS includes: every rank's file holds 3·4·Ψ_r bytes, and each continuation is within tolerance
    assert "PASS: 07_checkpoint" in out and f"{precision}: each continuation equals" in out, out
    index = json.loads((Path(scratch(f"l07{precision}")) / "step-000002" / "index.json").read_text())
    assert {t["dtype"] for t in index["tensors"].values()} == {"float32"}     # masters, m, v
    assert (index["scaler"] is not None) == (precision == "fp16")
    runs = json.loads(Path(scratch(f"l07{precision}.json")).read_text())["runs"]
    assert [r["name"] for r in runs] == ["dp 2 x tp 2", "ZeRO-1, dp 2", "1 process"]
    assert all(r["precision"] == precision for r in runs)
    assert runs[0]["rel_err"] < 1e-6
    for r in runs[1:]:                                         # tp = 1: the same rounding points
        assert r["rel_err"] == 0.0 and r["loss"] == r["baseline_loss"], r
