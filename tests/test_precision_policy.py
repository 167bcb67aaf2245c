"""The precision policy (pdist/engine/precision.py, pdist/engine/grad_rounding.py): one object
handed to the strategies, whose fp32 twin rounds nothing and copies nothing; fp16's loss
scale as compute's argument; the dtype facts in the backend, not in comm or the strategies."""
import ast
import pathlib

import numpy as np
import pytest

from pdist.course import lesson
from pdist.engine import backend, precision
from pdist.engine.grad_rounding import FullGradAccumulator, GradAccumulator
from pdist.engine.precision import FullPrecisionPolicy, MixedPrecisionPolicy, policy_for, policy_of
from pdist.models.gpt import GPT
from pdist.parallel import Local, MixedPrecision

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=1, n_head=2, n_embd=16)


def batch(rows=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (rows, CFG.block_size))
    return x, np.roll(x, -1, axis=1)


def grads(strategy):
    return {n: p.grad.copy() for n, p in strategy.module.named_parameters()}


def test_policies_by_name_and_by_dtype():
    assert policy_for("fp32") == FullPrecisionPolicy() and policy_for("fp32").param_dtype is None
    assert policy_for("bf16") == MixedPrecisionPolicy(backend.bfloat16) != policy_for("fp16")
    assert policy_for("fp16").param_dtype == np.float16 and policy_for("fp16").precision == "fp16"
    assert policy_of(GPT(CFG, 0).parameters()) == FullPrecisionPolicy()
    assert policy_of(precision.cast_module(GPT(CFG, 0), "bf16").parameters()) == policy_for("bf16")
    with pytest.raises(ValueError, match="FullPrecisionPolicy"):
        MixedPrecisionPolicy(np.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        policy_for("fp8")


def test_fp32_keepers_round_nothing_and_copy_nothing():
    """The fp32 twin: backward on S l / k, no sums of its own, ``.grad`` left as backward wrote it;
    bf16/fp16 with one micro-batch gets the same twin (its gradient is rounded once already)."""
    full, low = FullPrecisionPolicy(), policy_for("bf16")
    assert not full.late_grads(4) and low.late_grads(4) and not low.late_grads(1)
    m = Local(GPT(CFG, 0), microbatches=2)
    m.compute(*batch())
    before = {n: (p.grad, p.grad.copy()) for n, p in m.module.named_parameters()}
    acc = full.accumulator(m.parameters(), 4)
    assert type(acc) is FullGradAccumulator and acc.backward_scale(2.0) == 0.5
    acc.add()
    acc.finish()
    for n, p in m.module.named_parameters():
        assert p.grad is before[n][0] and np.array_equal(p.grad, before[n][1]), n
    assert type(low.accumulator(m.parameters(), 1)) is FullGradAccumulator
    assert type(low.accumulator(m.parameters(), 2)) is GradAccumulator
    assert low.accumulator(m.parameters(), 2).backward_scale(2.0) == 2.0


@pytest.mark.parametrize("prec,k", [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2), ("bf16", 3)])
def test_loss_scale_reaches_backward_as_an_argument(prec, k):
    """compute(x, y, loss_scale=S): every gradient is S times the unscaled one, exactly (S a
    power of two; bf16 has fp32's exponent range, so nothing is flushed at either scale)."""
    x, y = batch(rows=6)
    one = Local(precision.cast_module(GPT(CFG, 0), prec), microbatches=k)
    scaled = Local(precision.cast_module(GPT(CFG, 0), prec), microbatches=k)
    one.compute(x, y)
    scaled.compute(x, y, loss_scale=2.0 ** 6)
    g1, g2 = grads(one), grads(scaled)
    assert any(np.any(g != 0) for g in g1.values())
    for n in g1:
        assert np.array_equal(g2[n].astype(np.float64), g1[n].astype(np.float64) * 2.0 ** 6), n


def test_mixed_precision_hands_its_policy_to_a_chain_built_before_the_cast():
    """A chain built on the fp32 model and cast afterwards (as lesson 04 casts after tensor
    parallelism) rounds as one process once MixedPrecision hands it the bf16 policy."""
    late = Local(GPT(CFG, 0), microbatches=2)
    assert late.policy == FullPrecisionPolicy()
    precision.cast_module(late.module, "bf16")
    late_m = MixedPrecision(late, "bf16")
    assert late.policy == late_m.policy == policy_for("bf16")
    ref = MixedPrecision(Local(precision.cast_module(GPT(CFG, 0), "bf16"), microbatches=2), "bf16")
    x, y = batch()
    assert late_m.forward_backward(x, y) == ref.forward_backward(x, y)
    g_late, g_ref = grads(late_m), grads(ref)
    for n in g_ref:
        assert np.array_equal(g_late[n], g_ref[n]), n


def _parse(path):
    """(modules imported from, names used, attributes read or written) of one source file."""
    nodes = list(ast.walk(ast.parse(path.read_text())))
    return ({n.module for n in nodes if isinstance(n, ast.ImportFrom)},
            {n.id for n in nodes if isinstance(n, ast.Name)}, {n.attr for n in nodes if isinstance(n, ast.Attribute)})


def test_dtype_facts_live_in_the_backend_not_in_comm_or_the_strategies():
    """comm/ asks the backend which dtypes are 2-byte floats; Local, TensorParallel and
    PipelineParallel never ask which dtype they hold (their policy's keepers do the rounding),
    and no layer reads or writes a loss scale on another (it is compute's argument)."""
    for path in sorted((ROOT / "pdist" / "comm").glob("*.py")):
        assert "pdist.engine.precision" not in _parse(path)[0], path
    for rel in ("parallel/base.py", "parallel/tensor/tensor_parallel.py", "parallel/pipeline/pipeline_parallel.py",
                "parallel/mixed_precision.py"):
        _, names, attrs = _parse(ROOT / "pdist" / rel)
        found = (names & {"is_low", "GradAccumulator", "PartialGrads", "PipelineGrads"}) | (attrs & {"is_low",
                                                                                                      "loss_scale"})
        assert not found, (rel, found)
        if rel != "parallel/mixed_precision.py":     # (MixedPrecision's .low: its low-precision tensors)
            assert "low" not in attrs, rel
    assert backend.is_low(backend.bfloat16) and backend.is_low(np.dtype(np.float16))
    assert not backend.is_low(np.dtype(np.float32))
    assert backend.words(np.ones(3, np.float16)).dtype == np.uint16
