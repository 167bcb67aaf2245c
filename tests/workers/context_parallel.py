"""Context parallelism equals one process (float64, rtol 1e-9), every case in one launch.

    mpiexec -n 2 python tests/workers/context_parallel.py      # cp 2
    mpiexec -n 4 python tests/workers/context_parallel.py      # cp 2 x dp 2, cp 4, ZeRO-1 and -3

Op cases (the whole world is the cp group): ring (contiguous, zigzag) and Ulysses attention,
fused [Q|K|V] and grouped-query q, k, v, on this rank's tokens against
pdist.engine.attention on the whole sequence: y, dQ, dK, dV shard by shard, and the bytes
each rank sends, forward and backward, against ring_bytes / ulysses_bytes exactly. The
planted stale-K/V backward (backward reuses the previous block's K/V) must leave y equal
and dK/dV wrong, and must fail the training check. Training cases: K AdamW steps of
``parallelize(..., context_parallel=)`` on GPT-2 and Llama against single-process training
on the same global batches: every loss, every piece of every parameter and of Adam's m, v;
every rank trains on B/dp rows of T/cp tokens. Refusals: Ulysses with heads that do not split.
(The compositions with tp, pp, ZeRO and low precision: tests/workers/cp_compose.py.)
Each case prints one report (pdist.testing.report)."""
import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine import attention
from pdist.engine.autograd import Tensor
from pdist.engine.backend import is_gpu, set_default_dtype, to_numpy, xp
from pdist.measure.activation_memory import formula_bytes, measure_block
from pdist.models.gpt import GPT
from pdist.models.llama import Llama, LlamaConfig
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.parallel.context import ring_attention as ring
from pdist.parallel.context.ring_attention import RingAttention, ring_attention, ring_bytes
from pdist.parallel.context.ulysses import ulysses_attention, ulysses_bytes
from pdist.parallel.context.zigzag import attention_work, positions
from pdist.testing import check_shards, report

set_default_dtype("float64")
world = comm.init()
N, B, T, SEED, STEPS = world.size, 4, 16, 3, 2
TOL = dict(rtol=1e-9, atol=1e-12)
tokens, _ = data.char_dataset(20_000)
batch = data.batch_fn(tokens, B, T, SEED, 96)
CONFIGS = {"gpt2": (GPT, lambda: lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=2, n_head=4,
                                                   n_embd=16)),
           "llama": (Llama, lambda: LlamaConfig(vocab_size=96, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                                                n_embd=16, intermediate_size=24, dtype="float64"))}


def close(a, b):
    return np.allclose(to_numpy(a), to_numpy(b), **TOL)


def op_case(kind, layout, fused, n_head=4, n_kv=2, hs=4):
    """One attention call on this rank's tokens vs the whole sequence: (y ok, grads ok, bytes)."""
    rng = np.random.default_rng(7)
    n_kv = n_head if fused else n_kv
    widths = (n_head * hs, n_kv * hs, n_kv * hs)
    full = [rng.standard_normal((2, T, w)) for w in widths]
    G = xp.asarray(rng.standard_normal((2, T, n_head * hs)))        # (on the device too: PDIST_DEVICE=gpu)
    ins = [Tensor(xp.asarray(np.concatenate(full, -1) if fused else a), requires_grad=True)
           for a in ([0] if fused else full)]
    ref = attention.CausalAttention.apply(*ins, n_head=n_head, n_kv_head=n_kv)
    ref.backward(G)
    pos = xp.asarray(positions(T, N, world.rank, layout))
    mine = [Tensor(xp.ascontiguousarray(t.data[:, pos]), requires_grad=True) for t in ins]
    world.reset_stats()
    ring.work["scores"] = 0
    if kind == "ring":
        y = ring_attention(*mine, n_head=n_head, n_kv_head=n_kv, group=world, layout=layout)
        want = ring_bytes(2, T, N, n_kv, hs, 8)
    else:
        y = ulysses_attention(*mine, n_head=n_head, n_kv_head=n_kv, group=world)
        want = ulysses_bytes(2, T, N, n_head, n_kv, hs, 8)
    fwd, calls = world.bytes_sent(), _calls()
    if kind == "ring":  # the work it did is the formula's: the causal chunks skipped, zigzag balanced
        assert ring.work["scores"] == attention_work(T, N, layout)[world.rank], (layout, ring.work)
    y.backward(xp.ascontiguousarray(G[:, pos]))
    got = (fwd, world.bytes_sent() - fwd)
    # ring: (cp - 1) K/V sends forward, (cp - 1) K/V + (cp - 1) dK/dV backward; Ulysses: 4 all-to-alls each way
    assert (calls, _calls() - calls) == ((N - 1, 2 * (N - 1)) if kind == "ring" else (4, 4)), (kind, calls, _calls())
    y_ok = close(y.data, ref.data[:, pos])
    g_ok = all(close(m.grad, t.grad[:, pos]) for m, t in zip(mine, ins))
    return y_ok, g_ok, list(got), list(want)


def _calls():
    return sum(world.stats.get(op, {}).get("calls", 0) for op in ("send", "all_to_all"))


def op_cases():
    for kind, layout in (("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "contiguous")):
        for fused in (True, False):
            if kind == "ulysses" and not fused and 2 % N:
                continue                       # n_kv_head 2 does not split over cp 4 (refused below)
            y_ok, g_ok, got, want = op_case(kind, layout, fused)
            assert y_ok and g_ok and got == want, (kind, layout, fused, y_ok, g_ok, got, want)
            report(case="op", kind=kind, layout=layout, fused=fused, rank=world.rank, bytes=got,
                   work=ring.work["scores"] if kind == "ring" else None)


def stale_case():
    """Backward reuses the previous block's K/V: y stays equal, dK/dV go wrong, no error."""
    keep = RingAttention._kv_for_step
    RingAttention._kv_for_step = staticmethod(lambda previous, received: previous)
    try:
        y_ok, g_ok, _, _ = op_case("ring", "zigzag", False)
        trained = train_case("gpt2", "ring", dp=1, raise_=False)
    finally:
        RingAttention._kv_for_step = keep
    assert y_ok and not g_ok and not trained, ("the planted stale-K/V bug went unnoticed", y_ok, g_ok, trained)
    report(case="stale", rank=world.rank, forward_equal=y_ok, grads_equal=g_ok, training_equal=trained)


def reference(cls, cfg):
    model = cls(cfg, SEED)
    opt = AdamW(model.parameters(), lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS, weight_decay=lesson.WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        _, loss = model(*batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), {n: opt.state[id(p)] for n, p in model.named_parameters()}


_refs = {}


def train_case(name, mode, dp, zero=0, raise_=True, recompute="none", microbatches=1):
    """K steps under context_parallel=mode on a (dp, cp = N / dp) mesh vs one process."""
    cls, make = CONFIGS[name]
    cfg = make()
    mesh = comm.DeviceMesh(dp=dp, cp=N // dp)
    cfg.recompute = recompute
    model = parallelize(cls(cfg, SEED), mesh, zero_stage=zero, context_parallel=mode, microbatches=microbatches)
    cfg.recompute = "none"                   # (the reference: one process, no recompute)
    opt = AdamW(model.parameters(), lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS, weight_decay=lesson.WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        x, y = model.local_batch(*batch(step))
        assert x.shape == (B // dp, T // mesh.cp_world_size) == model.local_shape, (x.shape, dp, mesh)
        losses.append(model.forward_backward(x, y, step=step))
        opt.step()
        opt.zero_grad()
    if name not in _refs:
        _refs[name] = reference(cls, cfg)
    ref_losses, ref_sd, ref_state = _refs[name]
    try:
        np.testing.assert_allclose(losses, ref_losses, **TOL)
        checked = check_shards(model.sharded_state_dict(opt), ref_sd, lambda n, s: ref_state[n][s], close,
                               (name, mode, dp, zero))
        full = model.full_state_dict()       # gathered over the dp x cp ranks: one process's state_dict
        assert sorted(full) == sorted(ref_sd) and all(close(full[k], ref_sd[k]) for k in ref_sd), (name, mode)
    except AssertionError:
        if raise_:
            raise
        return False
    report(case="train", model=name, mode=mode, dp=dp, cp=mesh.cp_world_size, zero=zero, rank=world.rank,
           pieces=checked, losses=losses, recompute=recompute, microbatches=microbatches)
    return True


def memory_case():
    """A GPT block's activations per rank under ring CP, measured (pdist.measure.activation_memory)
    against pdist's formula at s = T/cp tokens: 24 s b h + 2 s b as one process (its P replaced by)
    K/V (2 s b h) and the log-sum-exp (a s b): every term is proportional to T/cp."""
    cls, make = CONFIGS["gpt2"]
    cfg = make()
    model = parallelize(cls(cfg, SEED), comm.DeviceMesh(cp=N), context_parallel="ring-zigzag")
    model.local_batch(*batch(0))                               # sets this rank's positions
    s, h, a = T // N, cfg.n_embd, cfg.n_head
    x = Tensor(xp.asarray(np.random.default_rng(1).standard_normal((B, s, h))), requires_grad=True)
    got, _ = measure_block(model.module.transformer.h[0], x)
    want = 8 * (24 * s * B * h + 2 * s * B + 2 * s * B * h + a * s * B)
    assert got == want or is_gpu(), (got, want)  # (the host's formula: other ops keep more on a device)
    report(case="memory", rank=world.rank, cp=N, bytes=got, one_process=formula_bytes(cfg, B, "none", 8))


def refused(fn, *needles):
    try:
        fn()
    except ValueError as e:
        assert all(s in str(e) for s in needles), (str(e), needles)
        return str(e)
    raise AssertionError(f"not refused: {needles}")


op_cases()
memory_case()
if N == 2:
    for name in ("gpt2", "llama"):
        for mode in ("ring", "ring-zigzag", "ulysses"):
            train_case(name, mode, dp=1)
    train_case("gpt2", "ring-zigzag", dp=1, recompute="selective", microbatches=2)
    stale_case()
    msg = refused(lambda: parallelize(Llama(LlamaConfig(vocab_size=96, block_size=T, n_head=4, n_kv_head=1,
                                                        n_embd=16, dtype="float64"), SEED),
                                      comm.DeviceMesh(cp=2), context_parallel="ulysses"), "n_kv_head = 1", "ring")
else:
    mesh = comm.DeviceMesh(dp=2, cp=2)      # tp-cp-dp-pp order: cp next to tp, then dp
    d, c = divmod(world.rank, 2)
    assert (mesh.dp_rank, mesh.cp_rank) == (d, c) and mesh.rank_of(dp=d, cp=c) == world.rank, mesh
    assert mesh.cp_group.ranks == [2 * d, 2 * d + 1] and mesh.dp_group.ranks == [c, 2 + c], mesh
    assert mesh.dp_cp_group.ranks == [0, 1, 2, 3], mesh.dp_cp_group.ranks
    train_case("gpt2", "ring-zigzag", dp=2)
    train_case("llama", "ulysses", dp=2)
    train_case("gpt2", "ring", dp=2, zero=1)
    train_case("llama", "ring", dp=2, zero=3)
    train_case("gpt2", "ring", dp=1)
    train_case("llama", "ring-zigzag", dp=1)
    train_case("gpt2", "ulysses", dp=1)
    msg = refused(lambda: parallelize(Llama(CONFIGS["llama"][1](), SEED), comm.DeviceMesh(cp=4),
                                      context_parallel="ulysses"), "n_kv_head = 2", "cp = 4")
report(case="refused", rank=world.rank, message=msg)
