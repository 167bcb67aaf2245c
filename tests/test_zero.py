"""ZeRO stages 0-3 (issue 5) under real mpiexec: equivalence with single-process
training shard by shard (n = 1, 2, 3 with padding, 4), model-state bytes equal to the
paper's formula, bytes sent equal to the ring theory, the stage-2/3 schedule (gradients
freed as units are reduced, at most root + current + prefetched unit gathered), stage
3's peak bound, bad input; and lesson 03's JSON summary. Each test's run is a job of the suite's
launch at its world size (tests/shared_launch.py, tests/workers/jobs.py)."""
import json
from pathlib import Path

import pytest

from shared_launch import chosen, own, scratch, stops, world, text

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "zero_check.py"
LESSON = ROOT / "lessons" / "03_zero.py"


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py): the
    worker, then the lesson (at 2 ranks its bad flag, which stops every rank before any collective)."""
    every = {f"test_zero_stages_equal_single_process_and_formulas[{m}]": (m, [WORKER]) for m in (1, 2, 3, 4)}
    every["test_lesson_03_json_contract"] = (4, [LESSON, "--steps", 3, "--dtype", "float64",
                                                 "--json", scratch("l03.json")])
    every["test_lesson_03_bad_input_fails_on_every_rank"] = (2, stops(LESSON, "--batch-size", 5, "--steps", 1))
    every["test_lesson_03_dp_shard"] = (4, [LESSON, "--dp-shard", 2, "--steps", 2, "--dtype", "float64",
                                            "--json", scratch("l03_hsdp.json")])
    every["test_lesson_03_bad_dp_shard_fails_on_every_rank"] = (4, stops(LESSON, "--dp-shard", 3, "--steps", 1))
    return chosen(every, names, n)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zero_stages_equal_single_process_and_formulas(n, request):
    out = world(n, request)
    got = {r["case"]: r for r in own(request, out)}
    assert set(got) == {"stage 0", "stage 1", "stage 2", "stage 3", "stage 3 no prefetch", "stage 3 peak",
                        "bad input"}, out
    for case in ("stage 0", "stage 1", "stage 2", "stage 3"):
        assert got[case]["model_state_bytes"] == got[case]["formula_bytes"] and got[case]["n"] == n
    assert got["stage 3 peak"]["peak_bytes"] <= got["stage 3 peak"]["bound_bytes"]


def test_lesson_03_json_contract(request):
    n, steps = 4, 3
    path = Path(scratch("l03.json"))
    out = text(request, world(n, request))
    assert "PASS: 03_zero" in out, out
    for col in ("params", "grads", "optim", "formula", "sent/step", "theory", "peak", "baseline"):
        assert col in out, out
    s = json.loads(path.read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("03_zero", n, "PASS")
    assert [r["name"] for r in s["runs"]] == ["zero0", "zero1", "zero2", "zero3"]
    from pdist import data
    from pdist.course import lesson
    cfg = lesson.gpt_config(data.char_dataset()[1].vocab_size)
    psi = cfg.num_params()
    b = 8
    for stage, r in enumerate(s["runs"]):
        assert r["layout"] == {"dp": n, "tp": 1, "pp": 1, "zero_stage": stage}
        assert r["dtype"] == "float64" and r["params"] == psi
        P = psi if stage == 0 else r["params_padded"]
        assert P % n == 0 or stage == 0
        assert psi <= P < psi + 4 * n   # at most n - 1 padding elements in each of the 4 units
        want = {0: (b * P, b * P, 2 * b * P), 1: (b * P, b * P, 2 * b * P / n),
                2: (b * P, b * P / n, 2 * b * P / n), 3: (b * P / n, b * P / n, 2 * b * P / n)}[stage]
        assert [m["rank"] for m in r["memory_per_rank"]] == list(range(n))
        for m in r["memory_per_rank"]:
            assert (m["params_bytes"], m["grads_bytes"], m["optim_bytes"]) == want, (stage, m, want)
            assert m["peak_bytes"] >= sum(want)
        ring = (2 if stage < 3 else 3) * (n - 1) / n * b * P
        assert len(r["comm_bytes_per_step"]) == n
        sent = r["comm_bytes_per_step"]
        assert all(abs(x - ring) <= 4 for x in sent), (stage, sent, ring)   # 4 units: < 1 B rounding each
        assert len(r["loss"]) == len(r["baseline_loss"]) == steps
        assert all(abs(a - c) <= 1e-9 * abs(c) for a, c in zip(r["loss"], r["baseline_loss"]))
        assert r["seconds_per_step"] > 0


def test_lesson_03_bad_input_fails_on_every_rank(request):
    got = own(request, world(2, request))                 # exit 2 on every rank, before any collective
    assert sorted(r["rank"] for r in got) == [0, 1], got
    assert all(r["code"] == 2 and "does not divide by the 2 ranks" in r["out"] for r in got), got


def test_lesson_03_dp_shard(request):
    """--dp-shard 2 on 4 ranks: HSDP (2 replicas x 2-way shards) at stages 1-3, each group's bytes beside
    its formula (shard: ZeRO's with N = S; replicas: 2(R-1)/R·bΨ_pad/S), memory with N = S, PASS."""
    n, S, R, b = 4, 2, 2, 8
    out = text(request, world(n, request))
    assert "PASS: 03_zero" in out and "HSDP 2 x 2" in out, out
    for col in ("shard (2)", "replicas (2)", "2Ψ/S·(R-1)/R", "8Ψ+8Ψ/S"):
        assert col in out, out
    s = json.loads(Path(scratch("l03_hsdp.json")).read_text())
    assert s["check"] == "PASS" and [r["name"] for r in s["runs"]] == ["zero0", "hsdp1", "hsdp2", "hsdp3"]
    for stage, r in enumerate(s["runs"][1:], 1):
        assert r["layout"] == {"dp": n, "tp": 1, "pp": 1, "zero_stage": stage, "dp_replicate": R, "dp_shard": S}
        P = r["params_padded"]
        want = {"shard": (2 if stage < 3 else 3) * (S - 1) / S * b * P, "replicate": 2 * (R - 1) / R * b * P / S}
        for g, w in want.items():
            assert r["comm_bytes_per_group"][g]["theory"] == w
            assert all(abs(x - w) <= 4 for x in r["comm_bytes_per_group"][g]["sent"]), (stage, g, r)
        mem = {1: (b * P, b * P, 2 * b * P / S), 2: (b * P, b * P / S, 2 * b * P / S),
               3: (b * P / S, b * P / S, 2 * b * P / S)}[stage]
        assert all((m["params_bytes"], m["grads_bytes"], m["optim_bytes"]) == mem for m in r["memory_per_rank"])


def test_lesson_03_bad_dp_shard_fails_on_every_rank(request):
    got = own(request, world(4, request))                 # exit 2 on every rank, before any collective
    assert sorted(r["rank"] for r in got) == [0, 1, 2, 3], got
    assert all(r["code"] == 2 and "--dp-shard 3 must be a positive divisor of the 4 ranks" in r["out"]
               for r in got), got
