"""Activation recomputation (issue 14 part 4): recompute="none" | "selective" | "full".

Single process (float64): gradients and K = 3 AdamW steps are bit-equal across the modes;
each parameter's hooks fire once per backward; a Dropout inside a checkpoint draws the
same mask when recomputed. Memory: the bytes the graph of one block keeps alive (a walk
of the autograd graph: the data of every tensor reached and the arrays saved on every
node, each base buffer once, parameters excluded) equal pdist's re-derived formula for
every mode, and tracemalloc's count of NumPy's allocations over the block's forward
agrees. Distributed (real mpiexec, 2 and 4 ranks; tests/workers/recompute_equiv.py):
every layout trains the same with each mode (rtol 1e-12), ZeRO-3's, DDP's and the
pipeline's bytes per step are unchanged, and tensor parallelism's full recompute
repeats exactly each block's forward collectives (all-gathers and reduce-scatters with
sequence parallelism, all-reduces without)."""
import dataclasses
import tracemalloc

import numpy as np
import pytest

from pdist.measure import activation_memory as am
from pdist import nn
from pdist.engine.autograd import Tensor
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT, GPTConfig
from pdist.optim import AdamW
from pdist.engine.recompute import checkpoint
from shared_launch import own, world

MODES = ("none", "selective", "full")
CFG = GPTConfig(vocab_size=96, block_size=16, n_layer=3, n_head=4, n_embd=32, dtype="float64")


@pytest.fixture(autouse=True)
def float64():
    set_default_dtype("float64")
    yield
    set_default_dtype("float32")


def _train(mode, steps=3):
    model = GPT(dataclasses.replace(CFG, recompute=mode), seed=1)
    fired = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)
    losses, grads = [], []
    for _ in range(steps):
        x, y = rng.integers(0, 96, (4, 16)), rng.integers(0, 96, (4, 16))
        model.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        grads.append({n: p.grad.copy() for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads, model.state_dict(), fired


def test_gradients_and_steps_are_bit_equal_across_modes():
    ref = _train("none")
    assert set(ref[3].values()) == {3}
    for mode in ("selective", "full"):
        losses, grads, sd, fired = _train(mode)
        assert losses == ref[0], mode
        for g, rg in zip(grads, ref[1]):
            for n in rg:
                assert np.array_equal(g[n], rg[n]), (mode, n)
        for n in sd:
            assert np.array_equal(sd[n], ref[2][n]), (mode, n)
        assert fired == ref[3], mode                       # each parameter's hook: once per backward


def test_recompute_off_in_no_grad_and_bad_mode():
    model = GPT(dataclasses.replace(CFG, recompute="full"), seed=1)
    from pdist.engine.autograd import no_grad
    with no_grad():
        logits = model(np.zeros((1, 4), dtype=np.int64))
    assert logits._ctx is None
    with pytest.raises(ValueError, match="recompute must be one of"):
        GPTConfig(recompute="attention")


def test_checkpoint_contract_errors():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(TypeError, match="must return one Tensor"):
        checkpoint(lambda t: (t, t), x)


def test_lesson_flag_and_checkpoint_files_ignore_the_mode(tmp_path):
    from pdist import checkpoint as ckpt
    from pdist.course import lesson
    from pdist.parallel.base import Local
    p = lesson.parser()
    assert lesson.config_from_args(p.parse_args(["--recompute", "full"]), 96).recompute == "full"
    assert lesson.config_from_args(p.parse_args([]), 96).recompute == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["--recompute", "attention"])
    saved = Local(GPT(CFG, seed=1))                      # a checkpoint saved without recompute ...
    ckpt.save(saved, None, tmp_path / "step-1", 1)
    loaded = Local(GPT(dataclasses.replace(CFG, recompute="full"), seed=2))
    ckpt.load(loaded, None, tmp_path / "step-1")         # ... loads with it: the mode is not the model
    for (n, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
        assert np.array_equal(a.data, b.data), n


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, rng=np.random.default_rng(0))
        self.drop = nn.Dropout(0.5, seed=7)

    def forward(self, x):
        return self.drop(self.lin(x).tanh())


@pytest.mark.parametrize("preserve", [True, False])
def test_dropout_inside_checkpoint_draws_the_same_mask(preserve):
    x0 = np.random.default_rng(1).standard_normal((5, 8))
    plain, ck = _Noisy(), _Noisy()
    x1, x2 = Tensor(x0, requires_grad=True), Tensor(x0, requires_grad=True)
    y1 = plain(x1)
    y2 = checkpoint(ck, x2, preserve_rng_state=preserve)
    assert np.array_equal(y1.data, y2.data)
    (y1 * y1).sum().backward()
    (y2 * y2).sum().backward()
    same = np.array_equal(x1.grad, x2.grad) and np.array_equal(plain.lin.weight.grad, ck.lin.weight.grad)
    assert same == preserve                       # without the saved state the recompute draws another mask
    # preserved: later draws continue from where forward left the generator (as without checkpoint)
    assert (plain.drop.rng.bit_generator.state == ck.drop.rng.bit_generator.state) == preserve


def _numpy_bytes(fn):
    """NumPy's allocations still alive after fn(), in bytes (tracemalloc's NumPy domain)."""
    def live():
        numpy_only = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
        snap = tracemalloc.take_snapshot().filter_traces([numpy_only])
        return sum(t.size for t in snap.traces)
    tracemalloc.start()
    try:
        before = live()
        out = fn()
        return live() - before, out
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape", [(16, 4, 32, 3), (8, 2, 48, 5), (80, 2, 8, 2)],
                         ids=["T16a4C32B3", "T8a2C48B5", "T80a2C8B2-causal-blocks"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", MODES)
def test_block_activation_bytes_equal_the_formula(mode, dtype, shape):
    set_default_dtype(dtype)
    T, a, C, B = shape
    cfg = dataclasses.replace(CFG, recompute=mode, dtype=dtype, block_size=T, n_head=a, n_embd=C)
    block = GPT(cfg, seed=1).transformer.h[0]
    x = Tensor(np.random.default_rng(0).standard_normal((B, cfg.block_size, cfg.n_embd)), requires_grad=True,
               dtype=dtype)
    am.measure_block(block, x)[1].sum().backward()        # warm: the causal mask's cache
    traced, (measured, out) = _numpy_bytes(lambda: am.measure_block(block, x))
    want = am.formula_bytes(cfg, B, mode, np.dtype(dtype).itemsize)
    assert measured == want, (mode, measured, want)
    # tracemalloc sees what the graph holds: the new buffers (not the input) plus the output
    assert traced == measured - x.data.nbytes + out.data.nbytes, (traced, measured)
    out.sum().backward()
    if mode != "none":
        assert measured < am.formula_bytes(cfg, B, "none", np.dtype(dtype).itemsize)


def _extra(r, size):
    """Full recompute with tp repeats each block's forward collectives, on the micro-batch's
    (b, T, C): with sp 2 all-gathers and 2 reduce-scatters, (t-1)/t of it each; without,
    2 all-reduces, 2(t-1)/t each. Returns ({op: (calls, bytes)}) over the run."""
    t, m = size["tp"], size["microbatches"]
    calls = 2 * (r["n_layer"] // size["pp"]) * m * r["steps"]
    full = r["batch"] // size["dp"] // m * r["seq"] * r["n_embd"] * 8          # bytes of (b, T, C)
    if size["sp"]:
        return {op: (calls, calls * (t - 1) * full // t) for op in ("all_gather", "reduce_scatter")}
    return {"all_reduce": (calls, calls * 2 * (t - 1) * full // t)}


# One job of one launch per world size for the layouts of this session's batches
# (tests/shared_launch.py), each layout asserted by name; "n4-2of2" holds the two that
# `make test-fast` leaves out (conftest.SLOW).
BATCHES = {"n2": (2, ["--dp 2", "--dp 2 --zero 3 --microbatches 2", "--tp 2 --sp", "--tp 2", "--pp 2 --microbatches 2"]),
           "n4-1of2": (4, ["--dp 2 --pp 2 --microbatches 2", "--tp 2 --pp 2 --sp --microbatches 2",
                           "--dp 2 --tp 2 --zero 3 --sp"]),
           "n4-2of2": (4, ["--dp 4 --zero 3", "--dp 2 --tp 2 --sp"])}


def suite_jobs(n, names):
    """This module's job at n ranks, for ``world`` (tests/shared_launch.py): the layouts of the batches
    at n of ``names``, this session's tests."""
    each = [a for b, (m, held) in BATCHES.items() if m == n and f"test_layouts_train_the_same_with_recompute[{b}]"
            in names for a in held]
    return {"layouts": ["tests/workers/recompute_equiv.py", "--each=" + ";".join(each)]} if each else {}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_layouts_train_the_same_with_recompute(batch, request):
    n, layouts = BATCHES[batch]
    out = world(n, request)
    got = own(request, out, "layouts")
    for layout in layouts:
        _check_layout(n, layout, [r for r in got if r["case"] == layout], out)


def _check_layout(n, layout, got, out):
    assert sorted(r["rank"] for r in got) == list(range(n)), (layout, out[-6000:])
    words = layout.split()
    size = {k: int(words[words.index(f"--{k}") + 1]) if f"--{k}" in words else 1
            for k in ("dp", "tp", "pp", "microbatches")}
    size["sp"] = "--sp" in words
    for r in got:
        assert r["checked"] > 0 and r["fired"] == [r["steps"] * size["microbatches"]], (layout, r)
        none, sel, full = (r["stats"][m] for m in MODES)
        assert sel == none, (layout, r)                           # the core attention has no collective
        for axis in ("dp", "pp"):
            assert full[axis] == none[axis], (layout, axis, r)    # ZeRO-3, DDP, pipeline: bytes unchanged
        if size["tp"] == 1:
            assert full["tp"] == none["tp"] == {}, (layout, r)
            continue
        extra = _extra(r, size)
        for op in set(none["tp"]) | set(full["tp"]):
            diff = [f - n for f, n in zip(full["tp"][op], none["tp"][op])]
            assert diff == list(extra.get(op, (0, 0))), (layout, op, diff, extra, r)
