"""Data parallelism (issue 4): equivalence with single-process training under real
mpiexec (n = 2, 4), overlap order, accounting, errors, and lesson 02's JSON."""
import json
from pathlib import Path

import numpy as np
import pytest

from pdist import nn
from pdist.parallel.data_parallel import build_buckets
from pdist.testing import MPIRunError, mpirun

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "dp_equiv.py"
LESSON = ROOT / "lessons" / "02_data_parallel.py"


@pytest.mark.parametrize("n", [2, 4])
def test_equivalence_overlap_errors(n):
    out = mpirun(n, WORKER, timeout=300)
    for what in ("naive accum=1", "naive accum=2", "bucketed accum=1", "bucketed accum=2"):
        assert f"ok {what} n={n}" in out, out
    assert "ok overlap" in out and f"ok errors and replica sync (n={n})" in out, out


def test_build_buckets_reverse_order_caps_and_dtypes():
    ps = [nn.Parameter(np.zeros(k, dtype=np.float64)) for k in (10, 10, 10, 40, 10)]  # 80, 80, 80, 320, 80 B
    ps.append(nn.Parameter(np.zeros(10, dtype=np.float32)))                           # 40 B, other dtype
    groups = build_buckets(ps, bucket_cap_bytes=200, first_bucket_cap_bytes=50)
    ids = [[ps.index(p) for p in g] for g in groups]
    # reverse order; first bucket small; a dtype change and an oversize parameter start new buckets
    assert ids == [[5], [4], [3], [2, 1], [0]]
    for g in groups:
        assert len({p.dtype for p in g}) == 1


@pytest.mark.parametrize("n", [1, 4])
def test_lesson_runs_and_writes_the_json_contract(tmp_path, n):
    path = tmp_path / "dp.json"
    out = mpirun(n, LESSON, "--steps", "3", "--json", path, timeout=300)
    assert f"PASS: 02_data_parallel -- {n} rank(s)" in out, out
    s = json.loads(path.read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("02_data_parallel", n, "PASS")
    assert [r["name"] for r in s["runs"]] == ["dp_naive", "dp_bucketed"]
    from pdist import data, lesson
    cfg = lesson.gpt_config(data.char_dataset()[1].vocab_size)
    psi = sum(int(np.prod(v)) for v in cfg.param_shapes().values())
    for r in s["runs"]:
        assert r["layout"] == {"dp": n, "tp": 1, "pp": 1, "zero_stage": 0}
        assert r["dtype"] == "float64" and r["params"] == psi
        assert len(r["loss"]) == len(r["baseline_loss"]) == 3
        np.testing.assert_allclose(r["loss"], r["baseline_loss"], rtol=1e-9)
        assert len(r["comm_bytes_per_step"]) == n
        for b in r["comm_bytes_per_step"]:     # ring accounting: 2(n-1)/n * Psi * 8 bytes per rank
            assert abs(b - 2 * (n - 1) / n * psi * 8) <= psi * 1e-3
        assert [m["rank"] for m in r["memory_per_rank"]] == list(range(n))
        assert all(m["params_bytes"] == psi * 8 == m["grads_bytes"] and m["optim_bytes"] >= 2 * psi * 8
                   for m in r["memory_per_rank"])
        assert r["seconds_per_step"] > 0


def test_lesson_rejects_a_batch_that_does_not_divide():
    with pytest.raises(MPIRunError) as e:
        mpirun(2, LESSON, "--steps", "1", "--batch-size", "7", timeout=120)
    assert "--batch-size 7 must divide into 2 ranks" in str(e.value)
