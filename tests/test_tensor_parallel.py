"""Tensor parallelism (issue 6): layers, whole-model equivalence, communication counts,
errors and lesson 04, each under a real mpiexec (pdist.testing.mpirun).

* tests/workers/tp_layers.py: every parallel layer's output and gradients (input, weight
  shard, bias) equal the single-process layer's slices at sizes 13*t and 17*t; the
  collectives of each layer's forward and backward counted exactly; bad sizes raise on
  every rank before any collective.
* tests/workers/tp_gpt.py: K AdamW steps of TensorParallel(GPT) (float64) equal single-process
  GPT shard by shard (rtol 1e-9), with and without sequence parallelism and with dropout;
  replicated grads bit-identical across ranks; collectives per step equal Megatron's count
  (2 + 2 all-reduces per layer plus the fixed embedding / head / loss ones) in calls and bytes.
"""
import json

import pytest

from pdist.testing import mpirun, reports

SIZES = [1, 2, 4]


@pytest.mark.parametrize("n", SIZES)
def test_layers(n):
    out = mpirun(n, "tests/workers/tp_layers.py", timeout=240)
    got = reports(out)
    assert sorted(r["rank"] for r in got) == list(range(n)) and all(r["checks"] > 10 for r in got), out


@pytest.mark.parametrize("n", SIZES)
def test_gpt_equivalence_and_comm_counts(n):
    out = mpirun(n, "tests/workers/tp_gpt.py", "3", timeout=300)
    got = reports(out)
    assert len(got) == (8 if n == 4 else 6) and all(r["world"] == n and r["worst"] <= 1 for r in got), out


def test_lesson_04(tmp_path):
    path = tmp_path / "tp.json"
    out = mpirun(2, "lessons/04_tensor_parallel.py", "--steps", "3", "--dtype", "float64",
                 "--json", str(path), timeout=300)
    assert "PASS: 04_tensor_parallel" in out, out
    s = json.loads(path.read_text())
    assert s["lesson"] == "04_tensor_parallel" and s["world_size"] == 2 and s["check"] == "PASS"
    assert [r["name"] for r in s["runs"]] == ["tp", "tp_sp"]
    L = 2  # pdist.lesson.gpt_config's n_layer
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


def test_lesson_04_rejects_bad_tp_size():
    """3 ranks cannot split 4 heads: every rank exits with the reason, nobody hangs."""
    from pdist.testing import MPIRunError
    with pytest.raises(MPIRunError) as e:
        mpirun(3, "lessons/04_tensor_parallel.py", "--steps", "1", timeout=120)
    assert "n_head = 4" in str(e.value) and "divisible by 3" in str(e.value)
