"""Data parallelism under mpiexec: equivalence with single-process training, replica
identity, overlap order, accounting and the errors, in one launch.

Every rank trains a small float64 GPT with AdamW for K steps on its shard of the
same global batches and compares each parameter with single-process training on
the global batch (pdist.lesson.train_reference, rtol 1e-9), for
{naive, bucketed} x {no accumulation, 2 micro-batches with no_sync()}; then checks
that all replicas hold bitwise-identical parameters."""
import hashlib

import numpy as np

from pdist import comm, data, gpt, lesson, trace
from pdist.backend import set_default_dtype, to_numpy
from pdist.parallel.data_parallel import DataParallel, DataParallelNaive

set_default_dtype("float64")
world = comm.init()
n, rank = world.size, world.rank
K, B, SEED = 3, 8, 7
tokens, tok = data.char_dataset()
cfg = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=8, n_layer=2, n_head=4, n_embd=32)
ref_losses, ref_state = lesson.train_reference(cfg, SEED, K, B, tokens=tokens)
# small caps so the little model spreads over several buckets
CAPS = dict(bucket_cap_mb=16 / 1024, first_bucket_cap_mb=4 / 1024)


def make(kind, seed=SEED, **kw):
    model = gpt.GPT(cfg, seed=seed)
    if kind == "naive":
        return DataParallelNaive(model, **kw)
    return DataParallel(model, **{**CAPS, **kw})


def train(dp, accum, zero_to_none=False):
    """K steps; each rank's shard is cut into ``accum`` micro-batches of loss / accum."""
    opt = lesson.make_adamw(dp.parameters())
    losses = []
    for step in range(K):
        x, y = dp.shard(data.get_batch(tokens, B, cfg.block_size, SEED, step))
        if zero_to_none:
            opt.zero_grad()          # p.grad = None: DataParallel must copy back into its buckets
        else:
            dp.zero_grad()
        mb = len(x) // accum
        local = 0.0
        for i in range(accum):
            xs, ys = x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]
            if i < accum - 1:
                with dp.no_sync():
                    _, loss = dp(xs, ys)
                    (loss * (1.0 / accum)).backward()
            else:
                _, loss = dp(xs, ys)
                (loss * (1.0 / accum)).backward()
            local += loss.item() / accum
        dp.finish_gradient_synchronization()
        opt.step()
        buf = np.array([local])
        world.all_reduce(buf, op="avg")
        losses.append(buf[0])
    return losses


def check_equal_to_reference(dp, losses, what):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9, atol=1e-12, err_msg=f"{what}: losses")
    for name, p in dp.module.named_parameters():
        np.testing.assert_allclose(to_numpy(p.data), ref_state[name], rtol=1e-9, atol=1e-12,
                                   err_msg=f"{what}: {name} differs from single-process training")
    digest = hashlib.sha1(b"".join(to_numpy(p.data).tobytes() for p in dp.parameters())).hexdigest()
    digests = world.all_gather_object(digest)
    assert len(set(digests)) == 1, f"{what}: replicas are not bitwise identical: {digests}"


def expect_error(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        for s in needles:
            assert s in str(e), f"error message lacks {s!r}: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} containing {needles}")


# --- 1. equivalence: {naive, bucketed} x {no accumulation, 2 micro-batches} -------------------
psi = sum(int(np.prod(s)) for s in cfg.param_shapes().values())
for kind in ("naive", "bucketed"):
    for accum in (1, 2):
        dp = make(kind)
        if kind == "bucketed":
            assert len(dp.buckets) >= 3, f"expected several buckets, got {len(dp.buckets)}"
        world.reset_stats()
        losses = train(dp, accum, zero_to_none=(kind == "bucketed" and accum == 2))
        what = f"{kind} accum={accum} n={n}"
        check_equal_to_reference(dp, losses, what)
        # one all-reduce of all gradients per step (+1 for the loss print), whatever accum is
        calls = len(dp.buckets) if kind == "bucketed" else len(list(dp.parameters()))
        st = world.stats["all_reduce"]
        assert st["calls"] == K * (calls + 1), f"{what}: {st['calls']} all-reduce calls"
        formula = 2 * (n - 1) / n * psi * 8 * K           # 2(n-1)/n * Psi * bytes, per step
        grad_bytes = st["bytes"] - K * (2 * (n - 1) * 8 // n)
        assert abs(grad_bytes - formula) <= K * calls, f"{what}: {grad_bytes} bytes vs {formula}"
        if rank == 0:
            print(f"ok {what}: K={K} steps equal single-process (rtol 1e-9), replicas identical, "
                  f"{grad_bytes / K:.0f} B/step vs 2(n-1)/n*Psi*8 = {formula / K:.0f}")

# --- 2. overlap: the first bucket's all-reduce is issued before backward finishes -----------------
for kind in ("bucketed", "naive"):
    dp = make(kind)
    x, y = dp.shard(data.get_batch(tokens, B, cfg.block_size, SEED, 0))
    trace.clear()
    _, loss = dp(x, y)
    with trace.span("backward", cat="compute"):
        loss.backward()
    with trace.span("sync", cat="compute"):
        dp.finish_gradient_synchronization()
    names = [(e["name"], e["args"]) for e in trace.events()]   # in the order they were recorded
    end_of_backward = names.index(("backward", {}))
    if kind == "bucketed":
        issued = [i for i, (nm, a) in enumerate(names) if nm == "dp.issue_bucket"]
        assert len(issued) == len(dp.buckets)
        assert names[issued[0]][1]["bucket"] == 0
        assert issued[0] < end_of_backward, f"bucket 0 issued after backward finished: {names}"
        during = sum(i < end_of_backward for i in issued)
        if rank == 0:
            print(f"ok overlap: {during} of {len(issued)} bucket all-reduces issued during backward")
    else:   # the control: the naive one communicates only after backward
        first = min(i for i, (nm, a) in enumerate(names) if nm == "all_reduce")
        assert first > end_of_backward

# --- 3. replicas: broadcast from rank 0, or verify ---------------------------------------------
dp = make("bucketed", seed=SEED + rank)               # different weights on every rank ...
ref0 = gpt.GPT(cfg, seed=SEED).state_dict()
for name, p in dp.module.named_parameters():           # ... are rank 0's after construction
    assert np.array_equal(to_numpy(p.data), ref0[name]), name
if n > 1:
    expect_error(ValueError, lambda: make("bucketed", seed=SEED + rank, init_sync="verify"),
                 "replicas differ", "init_sync='broadcast'")
make("naive", init_sync="verify")                       # identical replicas pass

# --- 4. clear errors, raised on every rank, no hang ---------------------------------------------
dp = make("bucketed")
if n > 1:
    expect_error(ValueError, lambda: dp.shard(data.get_batch(tokens, n + 1, cfg.block_size, SEED, 0)),
                 f"does not divide by the data-parallel size {n}")
    other = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=8, n_layer=1 + (rank == n - 1),
                              n_head=4, n_embd=32)
    expect_error(ValueError, lambda: DataParallel(gpt.GPT(other, seed=0)), "different model than rank 0",
                 f"ranks [{n - 1}]")
x, y = dp.shard(data.get_batch(tokens, B, cfg.block_size, SEED, 0))
_, loss = dp(x, y)
loss.backward()
expect_error(RuntimeError, lambda: dp(x, y), "finish_gradient_synchronization()")
dp.finish_gradient_synchronization()
with dp.no_sync():
    expect_error(RuntimeError, dp.finish_gradient_synchronization, "inside no_sync()")
expect_error(ValueError, lambda: DataParallel(gpt.GPT(cfg), bucket_cap_mb=0), "bucket caps must be > 0")
if rank == 0:
    print(f"ok errors and replica sync (n={n})")
