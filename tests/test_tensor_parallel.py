"""Tensor parallelism (issue 6): layers, whole-model equivalence, communication counts,
and errors, each under a real mpiexec (pdist.testing.mpirun).

* tests/workers/tp_layers.py: every parallel layer's output and gradients (input, weight
  shard, bias) equal the single-process layer's slices at sizes 13*t and 17*t; the
  collectives of each layer's forward and backward counted exactly; bad sizes raise on
  every rank before any collective.
* tests/workers/tp_gpt.py: K AdamW steps of TensorParallel(GPT) (float64) equal single-process
  GPT shard by shard (rtol 1e-9), with and without sequence parallelism and with dropout;
  replicated grads bit-identical across ranks; collectives per step equal Megatron's count
  (2 + 2 all-reduces per layer plus the fixed embedding / head / loss ones) in calls and bytes.
"""
import pytest

from shared_launch import chosen, own, world

SIZES = [1, 2, 4]


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py):
    the model, then the layers (which count from their own reset of the world's statistics)."""
    return chosen({f"test_gpt_equivalence_and_comm_counts[{n}]": ["tests/workers/tp_gpt.py", "3"],
                   f"test_layers[{n}]": ["tests/workers/tp_layers.py"]}, names)


@pytest.mark.parametrize("n", SIZES)
def test_layers(n, request):
    out = world(n, request)
    got = own(request, out)
    assert sorted(r["rank"] for r in got) == list(range(n)) and all(r["checks"] > 10 for r in got), out


@pytest.mark.parametrize("n", SIZES)
def test_gpt_equivalence_and_comm_counts(n, request):
    out = world(n, request)
    got = own(request, out)
    assert len(got) == (8 if n == 4 else 6) and all(r["world"] == n and r["worst"] <= 1 for r in got), out
