"""lessons/02_data_parallel.py and lessons/03_zero.py under mpirun: the PASS line, the
JSON summary contract, and bad flags stopping every rank with exit code 2 (jobs of one 2-rank
launch with lesson 02, tests/shared_launch.py; a bad layout run as a user runs it, with no
harness: tests/test_lesson_06.py)."""
import json
import os
from pathlib import Path

import pytest

from pdist.testing import mpirun
from shared_launch import chosen, own, scratch, stops, world
from shared_launch import text as job_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L02 = os.path.join(ROOT, "lessons", "02_data_parallel.py")
L03 = os.path.join(ROOT, "lessons", "03_zero.py")
L03_AT_3 = "::lesson 03 at 3 ranks, 2 steps"          # a job name tests/test_plan.py uses too
RUN_FIELDS = {"name", "layout", "dtype", "params", "loss", "baseline_loss", "memory_per_rank",
              "comm_bytes_per_step", "seconds_per_step"}
MEM_FIELDS = {"rank", "params_bytes", "grads_bytes", "optim_bytes"}


def check_summary(s, lesson, n, names, steps, dtype):
    assert s["lesson"] == lesson and s["world_size"] == n and s["check"] == "PASS"
    assert [r["name"] for r in s["runs"]] == names
    for r in s["runs"]:
        assert RUN_FIELDS <= set(r), set(r)
        assert r["dtype"] == dtype and r["params"] > 0
        assert len(r["loss"]) == steps and len(r["baseline_loss"]) == steps
        assert r["loss"] == pytest.approx(r["baseline_loss"], rel=1e-5)
        assert [m["rank"] for m in r["memory_per_rank"]] == list(range(n))
        assert all(MEM_FIELDS <= set(m) for m in r["memory_per_rank"])
        assert len(r["comm_bytes_per_step"]) == n and all(b > 0 for b in r["comm_bytes_per_step"])
        assert 0 < r["seconds_per_step"] < 10


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py; the RSS test has its own):
    at 2 ranks the bad flags first (each stops every rank before any collective, its output
    captured), then lesson 02; at 3 lesson 03, a job tests/test_plan.py shares (the same run)."""
    if n == 3:
        return {L03_AT_3: [L03, "--steps", "2", "--json", scratch("z-n3.json")]} \
            if "test_lesson_03_three_ranks" in names else {}
    return chosen({f"test_bad_flag_exits_2_on_every_rank[{s}]": stops(s, "--batch-size", "0") for s in (L02, L03)}
                  | {"test_lesson_02_two_ranks_float64_accum": [L02, "--dtype", "float64", "--steps", "3", "--accum",
                                                                "2", "--json", scratch("l02.json")]}, names) \
        if n == 2 else {}


def test_lesson_02_two_ranks_float64_accum(request):
    out = Path(scratch("l02.json"))
    text = job_text(request, world(2, request))
    assert "PASS: 02_data_parallel -- 2 rank(s)" in text, text
    assert "in 2 micro-batches" in text and "bucketed DP" in text
    s = json.loads(out.read_text())
    check_summary(s, "02_data_parallel", 2, ["dp_naive", "dp_bucketed"], 3, "float64")
    for r in s["runs"]:
        assert r["layout"] == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0}
        assert r["loss"] == pytest.approx(r["baseline_loss"], rel=1e-9)
        psi_bytes = r["params"] * 8
        assert r["comm_bytes_per_step"] == [psi_bytes, psi_bytes]      # 2(n-1)/n * Psi * b, n = 2


def test_lesson_03_three_ranks(request):
    out = Path(scratch("z-n3.json"))                  # the job of tests/test_plan.py at 3 ranks too
    text = job_text(request, world(3, request), L03_AT_3)
    assert "PASS: 03_zero (stages [0, 1, 2, 3] on 3 ranks" in text, text
    wide = [line for line in text.splitlines() if len(line) > 100]
    assert not wide, f"lesson 03 prints lines over 100 characters: {wide}"
    s = json.loads(out.read_text())
    check_summary(s, "03_zero", 3, ["zero0", "zero1", "zero2", "zero3"], 2, "float32")
    for stage, r in enumerate(s["runs"]):
        assert r["layout"] == {"dp": 3, "tp": 1, "pp": 1, "zero_stage": stage}
        assert {"params_padded", "comm_bytes_theory", "memory_formula"} <= set(r)
        assert all(abs(b - r["comm_bytes_theory"]) <= 4 for b in r["comm_bytes_per_step"])
        for m in r["memory_per_rank"]:
            assert {k: m[k] for k in r["memory_formula"]} == r["memory_formula"]
            assert m["peak_bytes"] > 0


@pytest.mark.parametrize("script", [L02, L03])
def test_bad_flag_exits_2_on_every_rank(script, request):
    got = own(request, world(2, request))
    assert sorted(r["rank"] for r in got) == [0, 1], got
    for r in got:                             # each rank: exit 2, the usage and the reason once, no verdict
        assert r["code"] == 2 and r["out"].count("--batch-size must be >= 1, got 0") == 1, r
        assert r["out"].count("usage:") == 1 and "PASS" not in r["out"] and "FAIL" not in r["out"], r


def test_lesson_03_rss_meta_init_and_timeline(tmp_path):
    """At Ψ ≈ 4.7 M on 2 ranks (issue 14): each rank's RSS (malloc's free pages returned) is
    baseline + the formula and its step peak baseline + the traced peak, within 15% (the
    lesson's --check-rss PASS); ZeRO-3's RSS falls from stage 0's as the formula says; the
    meta init of ZeRO-3 peaks at the shard + the largest parameter (+1 MiB of Python objects),
    stage 0 at the whole model; the timeline marks an all-gather and a free of every unit."""
    out, trace_path, png = tmp_path / "s.json", tmp_path / "t.json", tmp_path / "tl.png"
    text = mpirun(2, L03, "--steps", "2", "--n-layer", "6", "--n-embd", "256", "--block-size", "16",
                  "--batch-size", "2", "--check-rss", "--json", out, "--trace", trace_path, "--timeline", png,
                  timeout=240)
    assert "PASS: 03_zero" in text and "checked: within 15%" in text, text
    runs = json.loads(out.read_text())["runs"]
    psi = runs[0]["params"]
    for r in runs:
        assert r["rss_checked"]
    for rank in range(2):
        m = [r["memory_per_rank"][rank] for r in runs]
        grown = [x["rss_trimmed_bytes"] - x["rss_baseline_bytes"] for x in m]
        formula = [sum(r["memory_formula"].values()) for r in runs]
        for g, f in zip(grown, formula):
            assert abs(g - f) <= 0.15 * f, (grown, formula)
        assert grown[3] / grown[0] == pytest.approx(formula[3] / formula[0], rel=0.15), (grown, formula)
        init = [x["rss_init_peak_bytes"] - x["rss_baseline_bytes"] for x in m]
        largest = 4 * 256 * 1024                                            # mlp.c_fc, float32
        assert init[3] <= 4 * psi // 2 + largest + (1 << 20), (init, psi)   # the shard + the largest
        assert init[0] >= 4 * psi, (init, psi)                              # stage 0 holds the model
    ev = json.loads(trace_path.read_text())["traceEvents"]
    for pid in (0, 1):
        mine = [e for e in ev if e.get("pid") == pid and e.get("cat") == "memory"]
        units = {e["args"]["unit"] for e in mine if e["name"] == "free"}
        assert units == {"root"} | {f"unit{i}" for i in range(7)}, units     # ZeRO-3: wte+wpe, 6 blocks, ln_f
        assert units <= {e["args"]["unit"] for e in mine if e["name"] == "all-gather"}
        assert units <= {e["args"]["unit"] for e in mine if e["name"] == "reduce-scatter"}
        assert any(e.get("ph") == "C" and e["name"] == "memory" for e in ev if e.get("pid") == pid)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for stage in range(4):
        assert (tmp_path / f"tl.zero{stage}.png").stat().st_size > 10_000
