"""Whole-model equivalence of TensorParallel(GPT) with single-process GPT (float64), and its
communication counted exactly against Megatron's analysis.

For tensor parallelism with and without sequence parallelism (and one run with dropout),
K AdamW steps on the same global batches: every step's loss equals the single-process
loss, and afterwards every piece a rank holds (model.pieces()) equals the same box of the
single-process parameter (rtol 1e-9). Replicated parameters' grads are bit-identical on all tp ranks.
The logits a rank holds are its vocabulary slice only (B, T, V/t).
At 4 ranks the same runs also go through the tp groups of a DeviceMesh(dp=2, tp=2) (two
independent tp pairs; the world group must see no traffic).

Communication per step, counted from ProcessGroup.stats (S = B*T*C*8 bytes, N = B*T):
  TP:  forward 2 all-reduces per layer + 1 (embedding) + 2 (loss: max, sums),
       backward 2 per layer + 1 (the head's f).
  SP:  forward 2 all-gathers per layer + 1 (head), 2 reduce-scatters per layer + 1
       (embedding), 2 all-reduces (loss); backward the conjugates (all-gather <->
       reduce-scatter) + 1 all-reduce of the sequence-partial grads.
Bytes follow the ring accounting: all-reduce 2(t-1)/t*S, all-gather/reduce-scatter (t-1)/t*S.
Counts are checked at n_layer 1 and 2, so the per-layer slope is measured, not assumed."""
import sys

import numpy as np

from pdist import comm, data
from pdist.models import gpt
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.parallel import TensorParallel
from pdist.parallel.layout import box_slices
from pdist.testing import report

set_default_dtype("float64")
world = comm.init()
group = world  # the tp group; at 4 ranks also the tp groups of a DeviceMesh(dp=2, tp=2)
t, r = group.size, group.rank
K = int(sys.argv[1]) if len(sys.argv) > 1 else 3
B, T, SEED = 4, 16, 7
RTOL, ATOL = 1e-9, 1e-12
tokens, _ = data.char_dataset(50_000)
checks = []


def cfg_of(n_layer=2, dropout=0.0):
    return gpt.GPTConfig(vocab_size=96, block_size=T, n_layer=n_layer, n_head=4, n_embd=32,
                         dropout=dropout, dtype="float64")


def ring(nbytes, factor):
    return factor * (t - 1) * nbytes // t


def expected(cfg, sp):
    """(forward, backward) {op: (calls, bytes)} from Megatron's per-layer analysis."""
    L, S, N = cfg.n_layer, B * T * cfg.n_embd * 8, B * T
    loss = (2, ring(N * 8, 2) + ring(2 * N * 8, 2))  # all-reduce(max) of N, all-reduce(sum) of 2N
    if not sp:
        return ({"all_reduce": (2 * L + 1 + loss[0], (2 * L + 1) * ring(S, 2) + loss[1])},
                {"all_reduce": (2 * L + 1, (2 * L + 1) * ring(S, 2))})
    C = cfg.n_embd
    partial = (L * 6 * C + 2 * C + cfg.block_size * C) * 8  # LayerNorms, row biases, wpe
    half = (2 * L + 1, (2 * L + 1) * ring(S, 1))
    return ({"all_gather": half, "reduce_scatter": half, "all_reduce": loss},
            {"all_gather": half, "reduce_scatter": half, "all_reduce": (1, ring(partial, 2))})


def measured():
    return {op: (s["calls"], s["bytes"]) for op, s in group.stats.items()}


def check_counts(cfg, sp, fwd, bwd, what):
    if t == 1:
        assert fwd == {} and bwd == {}, f"{what}: t=1 must not communicate: {fwd} {bwd}"
        return
    ef, eb = expected(cfg, sp)
    assert fwd == ef, f"{what}: forward collectives {fwd} != Megatron's {ef}"
    assert bwd == eb, f"{what}: backward collectives {bwd} != Megatron's {eb}"


def same_on_all_ranks(a, what):
    blobs = group.all_gather_object(np.ascontiguousarray(to_numpy(a)).tobytes())
    assert all(x == blobs[0] for x in blobs), f"{what}: tp ranks hold different values"


def total(ef, eb):
    out = dict(ef)
    for op, (c, b) in eb.items():
        c0, b0 = out.get(op, (0, 0))
        out[op] = (c0 + c, b0 + b)
    return out


def run(cfg, sp, steps, what):
    ref = gpt.GPT(cfg, seed=SEED)
    ref_opt = lesson.make_adamw(ref.parameters())
    model = TensorParallel(gpt.GPT(cfg, seed=SEED), group, sequence_parallel=sp)
    opt = lesson.make_adamw(model.parameters())
    sd0 = ref.state_dict()
    for pc in model.pieces():  # init: exactly the slice of the single-process weights
        assert np.array_equal(to_numpy(pc.view(pc.tensor.data)), to_numpy(sd0[pc.name][box_slices(pc)])), f"{what}: init {pc}"
    for step in range(steps):
        x, y = data.get_batch(tokens, B, T, SEED, step)
        _, ref_loss = ref(x, y)
        ref.zero_grad()
        ref_loss.backward()
        ref_opt.step()

        group.reset_stats()
        loss = model.forward_backward(*model.local_batch(x, y))
        got = measured()
        want = {} if t == 1 else total(*expected(cfg, sp))
        assert got == want, f"{what} step {step}: collectives {got} != Megatron's {want}"
        assert np.isclose(loss, ref_loss.item(), rtol=RTOL, atol=ATOL), \
            f"{what} step {step}: loss {loss!r} != single-process {ref_loss.item()!r}"
        for pc in model.pieces():
            if pc.shape == pc.global_shape:  # replicated (split shards are smaller)
                same_on_all_ranks(pc.tensor.grad, f"{what} grad of replicated {pc.name}")
        opt.step()
        opt.zero_grad()
    from pdist.engine.autograd import no_grad
    with no_grad():
        logits = model.module(x)
    assert logits.shape == (B, T, cfg.vocab_size // t), f"{what}: rank holds logits {logits.shape}"
    sd = ref.state_dict()
    worst = 0.0
    for pc in model.pieces():
        want, got = to_numpy(sd[pc.name][box_slices(pc)]), to_numpy(pc.view(pc.tensor.data))
        assert np.allclose(got, want, rtol=RTOL, atol=ATOL), \
            f"{what}: {pc} differs from the single-process slice by {np.max(np.abs(got - want)):.3e}"
        worst = max(worst, float(np.max(np.abs(got - want) / (ATOL + RTOL * np.abs(want)))))
    checks.append({"case": what, "steps": steps, "worst": worst})


for sp in (False, True):
    run(cfg_of(2), sp, K, f"TP{' + SP' if sp else ''} n_layer=2")
    run(cfg_of(1), sp, 1, f"TP{' + SP' if sp else ''} n_layer=1 (counts)")
run(cfg_of(2, dropout=0.1), True, 2, "TP + SP with dropout 0.1")
run(cfg_of(2, dropout=0.1), False, 2, "TP with dropout 0.1")

if world.size == 4:  # two tp groups of 2 side by side (ranks {0,1} and {2,3}), as in a dp x tp mesh
    mesh = comm.DeviceMesh(dp=2, tp=2)
    group, (t, r) = mesh.tp_group, (mesh.tp_group.size, mesh.tp_group.rank)
    world.reset_stats()
    for sp in (False, True):
        run(cfg_of(2), sp, 2, f"DeviceMesh(dp=2, tp=2).tp_group{' + SP' if sp else ''}")
    assert world.stats == {}, f"the tp model used the world group: {world.stats}"

if world.rank == 0:
    for c in checks:
        report(world=world.size, **c)
