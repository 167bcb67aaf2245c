"""Lessons 04 (tensor parallelism) and 05 (pipeline parallelism) under real mpiexec:
their JSON summaries, and their flag checks (every rank stops before training, exit 2).

Each test runs its lesson as a job of one launch per world size (tests/shared_launch.py,
tests/workers/jobs.py), a flag check as a job expected to exit 2 (its output captured on every
rank, the launch going on), before the runs."""
import json
from pathlib import Path

import pytest

from shared_launch import chosen, own, scratch, stops, world, text

REPO = Path(__file__).resolve().parent.parent
L04, L05 = REPO / "lessons" / "04_tensor_parallel.py", REPO / "lessons" / "05_pipeline_parallel.py"


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py): the flag checks first."""
    every = {                                             # test: (world size, its job)
        "test_lesson_rejects_bad_flag[lessons/04_tensor_parallel.py-2]": (2, stops(L04, "--steps", "0")),
        "test_lesson_rejects_bad_flag[lessons/05_pipeline_parallel.py-2]": (2, stops(L05, "--steps", "0")),
        "test_lesson_04_rejects_bad_tp_size": (3, stops(L04, "--steps", "1")),
        "test_lesson_05_rejects_batch_before_training": (3, stops(L05, "--steps", "1")),
        "test_lesson_04": (2, [L04, "--steps", "3", "--dtype", "float64", "--json", scratch("l04.json")]),
        "test_lesson_04_mixed_precision": (2, [L04, "--steps", "3", "--precision", "fp16",
                                               "--json", scratch("l04h.json")]),
        "test_lesson_05_mixed_precision": (2, [L05, "--steps", "2", "--precision", "bf16", "--json", scratch("l05h.json"),
                                               "--n-layer", "4", "--n-embd", "32", "--block-size", "16"]),
        "test_lesson_05_json": (4, [L05, "--steps", "2", "--json", scratch("l05.json")])}
    return chosen(every, names, n)


def stopped(request, n):
    """Each rank's report of this test's job, expected to stop with exit 2: {rank: output}."""
    got = own(request, world(n, request))
    assert sorted(r["rank"] for r in got) == list(range(n)), got
    assert all(r["code"] == 2 for r in got), got
    return {r["rank"]: r["out"] for r in got}


def test_lesson_04(request):
    out = text(request, world(2, request))
    assert "PASS: 04_tensor_parallel" in out, out
    s = json.loads(Path(scratch("l04.json")).read_text())
    assert s["lesson"] == "04_tensor_parallel" and s["world_size"] == 2 and s["check"] == "PASS"
    assert [r["name"] for r in s["runs"]] == ["tp", "tp_sp"]
    L = 2  # pdist.course.lesson.gpt_config's n_layer
    for run in s["runs"]:
        assert run["layout"] == {"dp": 1, "tp": 2, "pp": 1, "zero_stage": 0}
        assert run["dtype"] == "float64" and run["params"] > 0
        assert len(run["loss"]) == len(run["baseline_loss"]) == 3
        assert run["loss"] == pytest.approx(run["baseline_loss"], rel=1e-9)
        assert len(run["comm_bytes_per_step"]) == 2 and all(b > 0 for b in run["comm_bytes_per_step"])
        assert [m["rank"] for m in run["memory_per_rank"]] == [0, 1]
        assert all(m["params_bytes"] < run["params"] * 8 for m in run["memory_per_rank"])  # slices only
        assert run["seconds_per_step"] > 0
    tp, sp = s["runs"]
    assert tp["collectives"]["per_layer_forward"] == {"all_reduce": 2}
    assert tp["collectives"]["per_layer_backward"] == {"all_reduce": 2}
    assert tp["collectives"]["per_step"] == {"all_reduce": 4 * L + 4}
    pair = {"all_gather": 2, "reduce_scatter": 2}
    assert sp["collectives"]["per_layer_forward"] == pair and sp["collectives"]["per_layer_backward"] == pair
    assert sp["collectives"]["per_step"] == {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 2,
                                             "all_reduce": 3}


def test_lesson_04_rejects_bad_tp_size(request):
    """3 ranks cannot split 4 heads: every rank exits 2 with the reason, nobody hangs."""
    outs = stopped(request, 3)
    assert all(f"[rank {r}] tensor parallelism over 3 ranks" in outs[r] for r in range(3)), outs
    assert all("n_head = 4" in out and "divisible by 3" in out for out in outs.values()), outs


@pytest.mark.parametrize("script,n", [("lessons/04_tensor_parallel.py", 2),
                                      ("lessons/05_pipeline_parallel.py", 2)])
def test_lesson_rejects_bad_flag(script, n, request):
    assert all(out.count("--steps must be >= 1, got 0") == 1 for out in stopped(request, n).values())


def test_lesson_05_rejects_batch_before_training(request):
    """p = 3 splits the batch into 1, 3 and 6 micro-batches: 16 rows cannot; every rank says so."""
    outs = stopped(request, 3)
    assert all(out.count("use a batch size divisible by 6") == 1 and "PASS" not in out for out in outs.values()), outs


def test_lesson_05_json(request):
    out = text(request, world(4, request))
    assert "PASS: 05_pipeline_parallel" in out, out
    assert "ZB-H1, p=4, m=8, planned" in out and "I7~W7+|" in out and "DualPipeV, p=4, m=4" in out, out
    s = json.loads(Path(scratch("l05.json")).read_text())
    assert s["lesson"] == "05_pipeline_parallel" and s["world_size"] == 4 and s["check"] == "PASS"
    names = [r["name"] for r in s["runs"]]
    for want in ("gpipe m=1", "gpipe m=8", "1f1b m=4", "1f1b m=8", "interleaved m=8 v=2", "1f1b m=4 pp2xdp2",
                 "zb-h1 m=8", "zb-v m=8 v=2", "dualpipev m=8 v=2"):
        assert want in names, names
    papers = {"zb-h1": 3 / (3 * 8 + 3), "zb-v": 3 / (6 * 8 + 3), "dualpipev": 3 / (6 * 8 + 3)}   # p = 4, m = 8
    for r in s["runs"]:
        p, dp = r["layout"]["pp"], r["layout"]["dp"]
        assert p * dp == 4 and r["layout"]["tp"] == 1 and r["dtype"] == "float64"
        assert r["loss"] == pytest.approx(r["baseline_loss"], rel=1e-9) and len(r["loss"]) == 2
        assert len(r["comm_bytes_per_step"]) == 4 and all(b > 0 for b in r["comm_bytes_per_step"])
        assert len(r["memory_per_rank"]) == 4 and r["params"] > 0 and r["seconds_per_step"] > 0
        m, v = r["microbatches"], r["chunks"]
        assert r["peak_stash_per_rank"][:: dp] == r["peak_stash_planned"]
        if r["schedule"] == "gpipe":
            assert r["peak_stash_planned"] == [m] * p
        if r["schedule"] == "1f1b":
            assert max(r["peak_stash_planned"]) <= p
        if r["schedule"] in papers:                # the planned bubble is the paper's formula, t_F = t_B = t_W
            assert r["bubble"]["theory"] == pytest.approx(papers[r["schedule"]], abs=1e-12)
            assert r["bubble"]["planned"] == pytest.approx(r["bubble"]["theory"], abs=1e-12)
        elif v == 1 or m % p == 0:
            assert r["bubble"]["theory"] == pytest.approx((p - 1) / (v * m + p - 1))
            assert r["bubble"]["planned"] == pytest.approx(r["bubble"]["theory"])
        assert len(r["bubble"]["measured_per_stage"]) == p
        assert all(0 <= b < 1 for b in r["bubble"]["measured_per_stage"])


def test_lesson_04_mixed_precision(request):
    """fp16 (with its loss scale) for TP and TP + SP against one process in fp16: losses and shards."""
    out = text(request, world(2, request))
    assert "PASS: 04_tensor_parallel" in out, out
    s = json.loads(Path(scratch("l04h.json")).read_text())
    assert [r["precision"] for r in s["runs"]] == ["fp16", "fp16"] and s["check"] == "PASS"


def test_lesson_05_mixed_precision(request):
    """bf16 pipelines (gpipe, 1f1b, interleaved) equal one process with m micro-batches bit for bit
    (a small model: 4 layers, two chunks per rank interleaved, width 32, T 16)."""
    out = text(request, world(2, request))
    assert "PASS: 05_pipeline_parallel" in out and "bf16: bit for bit" in out, out
    s = json.loads(Path(scratch("l05h.json")).read_text())
    assert s["check"] == "PASS" and {r["precision"] for r in s["runs"]} == {"bf16"}
    assert all(r["loss"] == pytest.approx(r["baseline_loss"], rel=1e-12) for r in s["runs"])
