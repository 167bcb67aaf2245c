"""Pipeline parallelism under real mpiexec: equivalence with single-process
training for every schedule (tests/workers/pp_equiv.py), and lesson 05's JSON."""
import json

import pytest

from pdist.testing import mpirun, reports


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pipeline_equals_single_process(n):
    out = mpirun(n, "tests/workers/pp_equiv.py", timeout=300)
    (got,) = reports(out)
    assert got["n"] == n and len(got["cases"]) == {1: 8, 2: 11, 4: 18}[n], out


def test_lesson_05_json(tmp_path):
    path = tmp_path / "pp.json"
    out = mpirun(4, "lessons/05_pipeline_parallel.py", "--steps", "2", "--json", str(path), timeout=300)
    assert "PASS: 05_pipeline_parallel" in out, out
    s = json.loads(path.read_text())
    assert s["lesson"] == "05_pipeline_parallel" and s["world_size"] == 4 and s["check"] == "PASS"
    names = [r["name"] for r in s["runs"]]
    for want in ("gpipe m=1", "gpipe m=8", "1f1b m=4", "1f1b m=8", "interleaved m=8 v=2", "1f1b m=4 pp2xdp2"):
        assert want in names, names
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
        if v == 1 or m % p == 0:
            assert r["bubble"]["theory"] == pytest.approx((p - 1) / (v * m + p - 1))
            assert r["bubble"]["planned"] == pytest.approx(r["bubble"]["theory"])
        assert len(r["bubble"]["measured_per_stage"]) == p
        assert all(0 <= b < 1 for b in r["bubble"]["measured_per_stage"])
