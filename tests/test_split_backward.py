"""The split backward (issue 27 part 1; Qi et al., 2024, "Zero Bubble Pipeline Parallelism").

``loss.backward(defer_weights=True, inputs=[x])`` runs B, dL/dx = dL/dy W^T for every
activation, and returns W, whose ``run()`` computes dL/dW = x^T dL/dy for every weight.
B then W must equal the whole backward BIT FOR BIT (np.array_equal, not allclose): every
parameter's ``.grad``, the input's ``.grad``, and the order the post-accumulate-grad hooks
fire in (DDP and ZeRO start their reductions there). Checked on GPT-2 (tied embedding)
and Llama (grouped-query attention, untied head), whole models and a single block fed by
an input leaf (a pipeline stage), with recompute "none" / "selective" / "full" and the
fp32 (float64 here), bf16 and fp16 policies. One process, small models, under a second.
"""
import numpy as np
import pytest

from pdist import nn
from pdist.engine import precision
from pdist.engine.autograd import Tensor
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT, GPTConfig
from pdist.models.llama import Llama, LlamaConfig

GPT_CFG = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="float64")
LLAMA_CFG = dict(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, dtype="float64")
MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16")


@pytest.fixture(autouse=True)
def float64():
    set_default_dtype("float64")
    yield
    set_default_dtype("float32")


def _model(arch, mode, prec):
    m = GPT(GPTConfig(**GPT_CFG, recompute=mode), seed=0) if arch == "gpt" else \
        Llama(LlamaConfig(**LLAMA_CFG, recompute=mode), seed=0)
    return precision.cast_module(m, prec)


def _batch():
    rng = np.random.default_rng(1)
    return rng.integers(0, 64, size=(3, 8)), rng.integers(0, 64, size=(3, 8))


def _hooked(params):
    fired = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda t, i=i: fired.append(i))
    return fired


def _grads(arch, mode, prec, split, block=False):
    """The gradients and the hooks' order of one backward of a fresh model."""
    model = _model(arch, mode, prec)
    params = model.parameters()
    fired = _hooked(params)
    idx, tgt = _batch()
    x = None
    if block:                             # one block fed by an input leaf, as a pipeline stage
        x = Tensor(np.random.default_rng(2).standard_normal((3, 8, 16)), requires_grad=True)
        y = model.blocks[1](x)
        loss = (y * y).sum()
    else:
        loss = model(idx, tgt)[1]
    if not split:
        loss.backward()
    else:
        w = loss.backward(defer_weights=True, inputs=[x] if x is not None else ())
        assert all(p.grad is None for p in params) and not fired, "B must leave every weight to W"
        assert x is None or x.grad is not None, "B must compute the input's gradient"
        assert w.nbytes > 0
        w.run()
    return [p.grad for p in params] + ([x.grad] if block else []), fired


@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_b_then_w_is_the_whole_backward_bit_for_bit(arch, mode, prec):
    for block in (False, True):
        whole, order = _grads(arch, mode, prec, False, block)
        split, split_order = _grads(arch, mode, prec, True, block)
        assert split_order == order, f"{arch} {mode} {prec}: the hooks fired in another order"
        assert sum(a is not None for a in whole) >= (7 if block else 20)
        for i, (a, b) in enumerate(zip(whole, split)):
            assert (a is None) == (b is None), f"{arch} {mode} {prec} block={block}: gradient {i} missing"
            assert a is None or (a.dtype == b.dtype and np.array_equal(a, b)), \
                f"{arch} recompute={mode} {prec} block={block}: gradient {i} differs"


def test_w_holds_what_dw_needs_and_runs_once():
    """y = x W (a Linear, then a norm): W holds x (N, in) and dL/dy (N, out) of the Linear,
    the norm's weight gradients (2 C) and the embedding-free graph nothing else; a second
    run() raises; inputs without defer_weights raises."""
    lin, ln = nn.Linear(8, 5), nn.LayerNorm(5)
    x = Tensor(np.random.default_rng(0).standard_normal((4, 8)), requires_grad=True)
    loss = (ln(lin(x)) ** 2).sum()
    w = loss.backward(defer_weights=True, inputs=[x])
    assert x.grad is not None and lin.weight.grad is None and ln.weight.grad is None
    assert w.nbytes == 8 * (4 * 8 + 4 * 5 + 2 * 5)        # x, dL/dy, the norm's dw and db
    w.run()
    assert lin.weight.grad is not None and ln.bias.grad is not None
    with pytest.raises(RuntimeError, match="run\\(\\) once"):
        w.run()
    with pytest.raises(ValueError, match="defer_weights=True"):
        (lin(x) ** 2).sum().backward(inputs=[x])
    w = Tensor(np.ones((8, 3)), requires_grad=True)          # a MatMul with a weight: its W holds x, not w
    loss = ((x @ w) ** 2).sum()
    held = loss.backward(defer_weights=True, inputs=[x])
    assert held.nbytes == 8 * (4 * 8 + 4 * 3) and w.grad is None
    held.run()
    assert np.array_equal(w.grad, 2 * x.data.T @ (x.data @ w.data))
