"""The planner's parts beside pdist's measured waterfall (pdist/plan/measured.py), on every lesson
layout: dp2, ZeRO-1..3 at dp2, tp2, pp2 1f1b m4 (one 2-rank launch); dp2 x tp2, and on the
simulated 2-node topology with tp inside vs across the nodes (one 4-rank launch).

What is held here, and why these tolerances (docs/planning.md, "Predicted vs measured on this
machine"). On a loaded 2-core machine (the suite runs beside other work; 4 ranks share 2
cores) host scheduling, not the link or the GEMMs, sets the time of every collective and of
the Python around the kernels; the per-part 15% claim is the bench's (bench/plan_vs_measured.py),
reported with its misses. The test holds what load cannot move, and what load can only add to:

    the waterfall's parts sum to the measured step within 3% (median step, every rank)
    ideal compute: the planner's equals the waterfall's (rel 1e-6): same FLOPs, same rate,
                   the layout (dp, tp, pp, m, rows) read right off the running strategy
    bytes and ring steps per group per step: the planner's equal what pdist's groups count
                   (bytes rel 1e-9, steps exactly: DDP's buckets, a pipeline rank's sends and
                   receives, tp's 4 all-reduces per layer + embedding, head and the loss's 2)
    the simulated link: what the transport charged the crossing tp group is at least 85% of
                   the planner's count on that link (sleeps only overshoot under load)
    the planner's step is a lower bound of the measured one, within 25% (load only adds; the
                   calibration and the steps are timed at different moments of the load)
"""
from pathlib import Path

import numpy as np
import pytest

from pdist.measure import waterfall_table
from pdist.plan import measured, measured_table
from pdist.testing import mpirun, reports

ROOT = Path(__file__).resolve().parent.parent
W = ROOT / "tests" / "workers" / "plan_measured_worker.py"
STEPS = "3"


def test_compare_verdicts_and_layout_errors():
    rows = {r[0]: r for r in measured.compare({"a": 1.0, "b": 0.01}, 2.0, {"a": 1.1, "b": 0.05, "c": 0.5})}
    assert rows["a"][4] == "rel" and rows["a"][5] and rows["a"][3] == pytest.approx(0.1)
    assert rows["b"][4] == "abs" and rows["b"][5]              # both under 5% of the step: 40 ms off is fine
    assert rows["c"][4] == "rel" and not rows["c"][5] and rows["c"][3] == float("inf")
    with pytest.raises(ValueError, match="no GPT/Llama config"):
        measured.layout_of(object(), (8, 16))


def test_one_process_plan_matches_the_waterfall_ideal_compute():
    from pdist.engine.backend import set_default_dtype
    from pdist.measure import waterfall
    from pdist.models.gpt import GPT, GPTConfig
    from pdist.parallel import Local
    set_default_dtype("float64")
    model = Local(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16), 0))
    wf = waterfall.Waterfall(model)
    x = np.random.default_rng(0).integers(0, 32, (4, 8))
    wf.start()
    model.forward_backward(x, x)
    parts = wf.stop()
    wf.close()
    plan = measured.plan_for(model, (4, 8))
    assert plan["layout"]["precision"] == "fp32" and plan["layout"]["micro_batch"] == 4
    assert plan["measured_parts"]["ideal compute"] == pytest.approx(parts["ideal compute"], rel=1e-6)
    # the per-op host cost: the architecture's op count is what pdist's calibration model applied,
    # and the planner charges it (ops x cost in the inefficiency, stepped tensors x cost in the overhead)
    from pdist.plan.arch import arch_of
    op_s, ops, step_s = measured._op[0]
    a = arch_of(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    assert ops == a.host_ops([0], True, True), (ops, measured._op)
    assert 1e-7 < op_s < 1e-2 and 0 < step_s < 1e-2 and plan["op_s"] == op_s
    mp = plan["measured_parts"]
    assert mp["kernel inefficiency"] + mp["ideal compute"] >= a.host_ops([0], True, True) * op_s, (mp, op_s)
    assert plan["measured_parts"]["framework overhead"] == pytest.approx(
        a.host_tensors([0], True, True) * step_s, rel=1e-9) == pytest.approx(len(list(model.parameters())) * step_s)


def _check(got):
    for name, res in got.items():
        _, step, rows = measured_table.side_by_side(res)
        for rank, r in enumerate(res["ranks"]):
            ratios = sorted(r["ratios"])
            assert abs(ratios[len(ratios) // 2] - 1) <= waterfall_table.CHECK, (name, rank, ratios)
            assert res["plan"]["ideal compute"] == pytest.approx(r["parts"]["ideal compute"], rel=1e-6), name
            for g, c in r["counted"].items():
                p = r["planned"][g]
                assert c["bytes"] == pytest.approx(p["bytes"], rel=1e-9), (name, rank, g, c, p)
                assert c["steps"] == p["steps"], (name, rank, g, c, p)
        if "tp across" in name:
            r = res["ranks"][0]
            assert r["counted"]["tp"]["charged_s"] >= 0.85 * r["planned"]["tp"]["charged_s"], (name, r)
        assert sum(res["plan"].values()) <= 1.25 * step, (name, measured_table.render(name, res))


@pytest.mark.cores(2)
def test_plan_beside_the_waterfall_2_ranks():
    got = reports(mpirun(2, W, 2, STEPS, timeout=240))[0]
    print("cpu_s", got.pop("cpu_s"))
    assert set(got) == {"dp2", "zero-1", "zero-2", "zero-3", "tp2", "pp2 1f1b m4"}, got.keys()
    _check(got)
    for name in got:
        print(measured_table.render(name, got[name]))


@pytest.mark.cores(2)
def test_plan_beside_the_waterfall_4_ranks_and_2_nodes():
    got = reports(mpirun(4, W, 4, STEPS, timeout=300))[0]
    print("cpu_s", got.pop("cpu_s"))
    assert set(got) == {"dp2xtp2", "2 nodes, tp inside", "2 nodes, tp across"}, got.keys()
    _check(got)
    # the planner's count on each group's simulated link: tp pays the inter-node link only across
    inside, across = (got[k]["ranks"][0]["planned"] for k in ("2 nodes, tp inside", "2 nodes, tp across"))
    sim = lambda lay, g: lay[g]["charged_s"]         # noqa: E731
    assert sim(across, "tp") > 5 * sim(inside, "tp") and sim(inside, "dp") > 5 * sim(across, "dp"), (inside, across)
    for name in got:
        print(measured_table.render(name, got[name]))
