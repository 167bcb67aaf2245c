"""The divergence bisector (pdist/faults/diverge.py) names a planted divergence exactly: one
2-rank launch (tests/workers/diverge_cases.py) records seven runs (one process, dp2 twice,
tp2, dp2 and one process with a planted change at step 2); the comparisons run here."""
import json
import os
import shutil

import pytest

from pdist.debug import main as debug_main
from pdist.faults.diverge import RunDirError, diverge
from pdist.testing import mpirun, reports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "diverge_cases.py")
PLANT = ("fwd", "transformer.h.1.mlp.c_proj", "out")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fingerprints")
    out = mpirun(2, WORKER, str(d), timeout=120)
    changed = {r["rank"]: r["changed"] for r in reports(out)}
    assert changed[1] and all(c > 0 for c in changed[1]), out    # the split-K plant changed some bits
    return d


def where(d):
    return d.step, (d.phase, d.op, d.tensor)


def test_layouts_agree_in_float64(runs):
    for b in ("dp2", "tp2", "dp2_splitk"):      # a split-K reorder moves float64 by ~1e-16: under 1e-9
        d = diverge(runs / "local", runs / b)
        assert not d.found and d.rtol == 1e-9 and d.tensors_compared > 250, (b, str(d))
    assert "no divergence" in str(d)


def test_planted_perturbation_named_across_layouts(runs):
    d = diverge(runs / "local", runs / "dp2_scaled")        # one process vs dp2, rank 1 scaled at step 2
    assert where(d) == (2, PLANT) and d.rank is None and d.ranks_b == [0, 1], str(d)
    assert 1e-9 < d.rel_diff < 1e-6, d.rel_diff


def test_planted_reduction_order_named_exactly(runs):
    assert not diverge(runs / "dp2", runs / "dp2b", rtol=0).found      # the same layout: the same bits
    d = diverge(runs / "dp2", runs / "dp2_splitk", rtol=0)
    assert where(d) == (2, PLANT) and d.rank == 1 and d.exact, str(d)
    d = diverge(runs / "local", runs / "local_splitk", rtol=0)
    assert where(d) == (2, PLANT) and d.rank == 0, str(d)


def test_exact_compare_names_the_first_split_reduction(runs):
    """The default mode's bits part where the layout first splits a sum: tp2 at the first
    row-parallel matmul's K-sum (forward, step 0); dp2 at the batch sum of a weight gradient."""
    d = diverge(runs / "local", runs / "tp2", rtol=0)
    assert where(d) == (0, ("fwd", "transformer.h.0.attn.c_proj", "out")), str(d)
    d = diverge(runs / "local", runs / "dp2", rtol=0)
    assert d.step == 0 and d.phase == "grad", str(d)


def test_deterministic_runs_compare_exactly(runs):
    """Recorded in the deterministic mode, the default comparison demands identical bits."""
    d = diverge(runs / "det_local", runs / "det_dp2")
    assert d.exact and d.rtol == 0 and not d.found and d.tensors_compared > 250, str(d)
    d = diverge(runs / "det_local", runs / "det_dp2_splitk")     # across layouts, a reduction-order change
    assert where(d) == (2, PLANT) and d.exact and d.rank is None, str(d)


def test_cli(runs, capsys):
    assert debug_main(["diverge", str(runs / "dp2"), str(runs / "dp2_splitk"), "--rtol", "0"]) == 1
    out = capsys.readouterr().out
    assert "runs part at step 2, fwd op transformer.h.1.mlp.c_proj tensor out, rank 1" in out, out
    assert debug_main(["diverge", str(runs / "local"), str(runs / "tp2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] is None


def test_bad_run_dirs(runs, tmp_path, capsys):
    with pytest.raises(RunDirError, match="is not a directory"):
        diverge(tmp_path / "nope", runs / "dp2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="holds no meta.json: not a fingerprinted run"):
        diverge(runs / "dp2", tmp_path / "empty")
    part = tmp_path / "part"
    shutil.copytree(runs / "dp2", part)
    os.remove(part / "rank-1.jsonl")
    with pytest.raises(RunDirError, match="rank-1.jsonl is missing: the run had 2 ranks"):
        diverge(runs / "local", part)
    (part / "rank-1.jsonl").write_text("{not json\n")
    with pytest.raises(RunDirError, match="rank-1.jsonl line 1 is not a fingerprint record"):
        diverge(runs / "local", part)
    other = tmp_path / "other"
    shutil.copytree(runs / "local", other)
    lines = [json.loads(line) for line in (other / "rank-0.jsonl").read_text().splitlines()]
    for rec in lines:                                   # another model: no op name in common
        rec["records"] = [[p, "other." + op, *rest] for p, op, *rest in rec["records"]]
    (other / "rank-0.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    with pytest.raises(RunDirError, match="share no tensor name"):
        diverge(runs / "local", other)
    with pytest.raises(ValueError, match="rtol must be >= 0"):
        diverge(runs / "local", runs / "dp2", rtol=-1)
    assert debug_main(["diverge", str(tmp_path / "nope"), str(runs / "dp2")]) == 2
    assert "error: diverge:" in capsys.readouterr().err
