"""The mixture-of-experts MLP (pdist/models/moe.py) on one process, float64: the routing
against a per-token loop written from the formulas (dropless and with a capacity, drops
counted), the gate/expert/input gradients by finite differences (tests/fdcheck.py), the
load-balancing loss, the config checks, the plan's notion of experts, and the dense
default unchanged."""
import dataclasses
import math

import numpy as np
import pytest

from fdcheck import grads_match
from pdist import Tensor
from pdist.models import moe
from pdist.models.gpt import GPT, GPTConfig
from pdist.models.llama import Llama, LlamaConfig
from pdist.models.plan import expert_of


def tiny(kind, **kw):
    if kind == "gpt":
        return GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=4, dtype="float64", **kw)
    return LlamaConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=4, intermediate_size=6,
                       dtype="float64", **kw)


def layer(kind, seed=0, **kw):
    cfg = tiny(kind, n_expert=kw.pop("E", 3), expert_top_k=kw.pop("k", 2), **kw)
    m = (GPT if kind == "gpt" else Llama)(cfg, seed=seed)
    return m.blocks[0].mlp


def reference(mlp, x):
    """y_n = sum_{e in top-k(p_n), kept} p_ne / sum_top p * expert_e(x_n), one token at a time;
    an expert takes first choices before second ones, in token order, up to its capacity."""
    N, E, k = x.shape[0], mlp.n_expert, mlp.top_k
    logits = mlp.gate(Tensor(x)).data
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = [sorted(range(E), key=lambda e: (-p[n, e], e))[:k] for n in range(N)]
    cap = math.inf if mlp.capacity_factor is None else math.ceil(mlp.capacity_factor * N * k / E)
    taken, kept = [0] * E, set()
    for j in range(k):
        for n in range(N):
            e = top[n][j]
            if taken[e] < cap:
                taken[e] += 1
                kept.add((n, e))
    y = np.zeros_like(x)
    for n in range(N):
        z = sum(p[n, e] for e in top[n])
        for e in top[n]:
            if (n, e) in kept:
                y[n] += p[n, e] / z * mlp.experts[e](Tensor(x[n:n + 1])).data[0]
    routed = np.bincount([e for t in top for e in t], minlength=E)
    return y, taken, routed, p


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("cf", [None, 1.0, 0.5])
def test_routing_equals_per_token_loop(kind, cf):
    mlp = layer(kind, seed=1, E=4, k=2, capacity_factor=cf)
    x = np.random.default_rng(2).standard_normal((13, 4))
    y = mlp(Tensor(x)).data
    want, taken, routed, _ = reference(mlp, x)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-14)
    s = moe.moe_stats(_Wrap(mlp))["mlp"]
    assert s["tokens"] == list(taken) and s["routed"] == routed.tolist() and s["calls"] == 1
    assert s["dropped"] == int(routed.sum() - sum(taken))
    assert (s["dropped"] == 0) if cf is None else (s["dropped"] > 0 or cf > 0.5), s   # dropless: none; c = 0.5: some


class _Wrap:
    """A model holding one MoE layer as ``mlp`` (for moe_stats)."""
    def __init__(self, m):
        self.m = m

    def named_modules(self):
        return [("mlp", self.m)]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("cf", [None, 0.75])
def test_gradients_by_finite_differences(kind, cf):
    """dx, the gate's and every expert's parameters (the router's gradient flows through
    the renormalised gate weights and the aux loss)."""
    mlp = layer(kind, seed=3, E=3, k=2, capacity_factor=cf, router_aux_loss_coef=0.3)
    named = list(mlp.named_parameters())
    x = np.random.default_rng(4).standard_normal((5, 4))

    def fn(x, *ps):
        for (name, _), t in zip(named, ps):            # the layer computes with the checked Tensors
            mod, _, leaf = name.rpartition(".")
            owner = mlp
            for part in filter(None, mod.split(".")):
                owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
            object.__setattr__(owner, leaf, t)
        return mlp(x) + mlp.aux_loss                    # (N, C): the aux loss broadcast onto every entry
    grads_match(fn, [x] + [p.data.copy() for _, p in named], rtol=1e-6, atol=1e-9)


def test_aux_loss_uniform_router_is_the_coefficient():
    """A zero gate: p uniform, P_e = 1/E, sum_e f_e = 1, so aux = coef * E * 1/E = coef."""
    mlp = layer("gpt", E=4, k=2, router_aux_loss_coef=0.25)
    mlp.gate.weight.data[...] = 0.0
    mlp(Tensor(np.random.default_rng(0).standard_normal((6, 4))))
    assert abs(float(mlp.aux_loss.data) - 0.25) < 1e-15
    mlp = layer("llama", E=4, k=1, router_aux_loss_coef=0.1, seed=5)
    x = np.random.default_rng(1).standard_normal((7, 4))
    mlp(Tensor(x))
    _, _, routed, p = reference(mlp, x)
    want = 0.1 * 4 * float(np.sum(routed / 7 * p.mean(0)))
    assert abs(float(mlp.aux_loss.data) - want) < 1e-14


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_model_loss_adds_aux_and_plan_records_experts(kind):
    cfg = tiny(kind, n_expert=4, expert_top_k=2, router_aux_loss_coef=0.5)
    m = (GPT if kind == "gpt" else Llama)(cfg, seed=0)
    names = [n for n, _ in m.named_parameters()]
    assert names == list(cfg.param_shapes()) and m.num_parameters() == cfg.num_params()
    experts = {expert_of(cfg.parallel_plan(), n) for n in names} - {None}
    blk = "transformer.h.0.mlp" if kind == "gpt" else "model.layers.0.mlp"
    assert experts == {(blk, e) for e in range(4)}
    assert expert_of(cfg.parallel_plan(), blk + ".gate.weight") is None
    x = np.random.default_rng(0).integers(0, 16, (2, 8))
    _, loss = m(x, np.roll(x, 1, 1))
    ce = float(loss.data) - float(moe.aux_loss(m).data)
    from pdist.engine import functional as F
    logits = m(x).data
    assert abs(ce - float(F.cross_entropy(Tensor(logits), np.roll(x, 1, 1)).data)) < 1e-12


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_dense_default_unchanged(kind):
    """n_expert = 0 (the default): no gate, no experts, the dense names and sizes."""
    cfg = tiny(kind)
    names = list(cfg.param_shapes())
    assert cfg.n_expert == 0 and not any(".gate." in n or ".experts." in n for n in names)
    assert cfg.parallel_plan().experts == {}
    C = cfg.n_embd
    mlp = 2 * C * 4 * C + 4 * C + C if kind == "gpt" else 3 * C * cfg.intermediate_size
    assert sum(math.prod(s) for n, s in cfg.param_shapes().items() if ".mlp." in n) == mlp


@pytest.mark.parametrize("bad, words", [({"n_expert": -1}, "n_expert must be >= 0"),
                                        ({"n_expert": 2, "expert_top_k": 3}, "expert_top_k must be in 1..n_expert=2"),
                                        ({"n_expert": 2, "capacity_factor": 0}, "capacity_factor"),
                                        ({"n_expert": 2, "router_aux_loss_coef": -1}, "router_aux_loss_coef")])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_bad_moe_config(kind, bad, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        tiny(kind, **bad)


def test_parallelize_refuses_moe_with_sp_and_cp():
    """MoE composes with tp, pp and ZeRO (tests/test_expert_parallel.py); what it does not
    compose with is refused before any collective, naming the layout and what to change."""
    from pdist.parallel.parallelize import check_layout

    class Mesh:
        dp_world_size, tp_world_size, pp_world_size, ep_world_size, cp_world_size = 1, 2, 1, 1, 1
    check_layout(tiny("llama", n_expert=2), Mesh(), zero_stage=3)                # tp x ZeRO-3: fine
    with pytest.raises(ValueError, match="sequence_parallel over tp=2.*use sequence_parallel=False"):
        check_layout(tiny("gpt", n_expert=2), Mesh(), sequence_parallel=True)
    pp = type("M", (Mesh,), {"tp_world_size": 1, "pp_world_size": 2})()
    two = dataclasses.replace(tiny("llama", n_expert=2), n_layer=2)
    check_layout(two, pp, microbatches=2, zero_stage=1)                          # pp x ZeRO-1: fine
    with pytest.raises(ValueError, match="context parallelism.*cp=2"):
        check_layout(tiny("gpt", n_expert=2), type("M", (Mesh,), {"tp_world_size": 1, "cp_world_size": 2})())
    check_layout(dataclasses.replace(two, n_layer=4), pp, schedule="interleaved", microbatches=2, chunks=2)
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model"):
        check_layout(tiny("gpt"), type("M", (Mesh,), {"tp_world_size": 1, "dp_world_size": 2, "ep_world_size": 2})())
