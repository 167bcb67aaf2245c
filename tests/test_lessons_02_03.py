"""lessons/02_data_parallel.py and lessons/03_zero.py under mpirun: the PASS line, the
JSON summary contract, and bad flags stopping every rank with exit code 2."""
import json
import os

import pytest

from pdist.testing import launch, mpirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L02 = os.path.join(ROOT, "lessons", "02_data_parallel.py")
L03 = os.path.join(ROOT, "lessons", "03_zero.py")
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


def test_lesson_02_two_ranks_float64_accum(tmp_path):
    out = tmp_path / "s.json"
    text = mpirun(2, L02, "--dtype", "float64", "--steps", "3", "--accum", "2", "--json", out, timeout=120)
    assert "PASS: 02_data_parallel -- 2 rank(s)" in text, text
    assert "in 2 micro-batches" in text and "bucketed DP" in text
    s = json.loads(out.read_text())
    check_summary(s, "02_data_parallel", 2, ["dp_naive", "dp_bucketed"], 3, "float64")
    for r in s["runs"]:
        assert r["layout"] == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0}
        assert r["loss"] == pytest.approx(r["baseline_loss"], rel=1e-9)
        psi_bytes = r["params"] * 8
        assert r["comm_bytes_per_step"] == [psi_bytes, psi_bytes]      # 2(n-1)/n * Psi * b, n = 2


def test_lesson_03_three_ranks(tmp_path):
    out = tmp_path / "s.json"
    text = mpirun(3, L03, "--steps", "2", "--json", out, timeout=120)
    assert "PASS: 03_zero (stages [0, 1, 2, 3] on 3 ranks" in text, text
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
def test_bad_flag_exits_2_on_every_rank(script):
    r = launch(2, script, "--batch-size", "0", timeout=60, wrap=False)       # as a user runs it
    assert r.rc == 2, r.out
    assert r.out.count("--batch-size must be >= 1, got 0") == 2, r.out       # both ranks
    assert r.out.count("usage:") == 2 and "PASS" not in r.out and "FAIL" not in r.out
