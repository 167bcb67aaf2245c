"""Data parallelism beyond equivalence (which tests/workers/layout_equiv.py checks):
bytes and calls per step, overlap, replica sync, and clear errors, on the world group.

Reports JSON (pdist.testing.report) on rank 0; any failed assert fails the mpirun."""
import numpy as np

from pdist import comm, data
from pdist.models import gpt
from pdist.course import lesson
from pdist.measure import trace
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.parallel import DataParallel, DataParallelNaive, Local
from pdist.testing import report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
n, rank = world.size, world.rank
K, B, SEED = 3, 8, 7
tokens, tok = data.char_dataset(50_000)
cfg = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=8, n_layer=2, n_head=4, n_embd=32)
CAPS = dict(bucket_cap_mb=16 / 1024, first_bucket_cap_mb=4 / 1024)   # several buckets for the little model
PSI = cfg.num_params()


def make(kind, seed=SEED, accum=1, **kw):
    model = Local(gpt.GPT(cfg, seed=seed), microbatches=accum)
    return DataParallelNaive(model, **kw) if kind == "naive" else DataParallel(model, **{**CAPS, **kw})


def batch(step):
    return data.get_batch(tokens, B, cfg.block_size, SEED, step)


def expect_error(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        for s in needles:
            assert s in str(e), f"error message lacks {s!r}: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} containing {needles}")


# --- 1. one all-reduce of all gradients per step, whatever the accumulation; 2(n-1)/n Ψ b bytes
ref_losses, _ = lesson.train_reference(cfg, SEED, K, B, tokens)
for kind in ("naive", "bucketed"):
    for accum in (1, 2):
        dp = make(kind, accum=accum)
        world.reset_stats()
        losses = train(dp, lesson.make_adamw(dp.parameters()), batch, K)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-9, atol=0)
        calls = len(dp.buckets) if kind == "bucketed" else len(dp.parameters())
        st = world.stats["all_reduce"]
        assert st["calls"] == K * calls, f"{kind} accum={accum}: {st['calls']} all-reduce calls, want {K * calls}"
        formula = 2 * (n - 1) / n * PSI * 8 * K
        assert abs(st["bytes"] - formula) <= K * calls, f"{kind}: {st['bytes']} bytes vs {formula}"
        if rank == 0:
            report(case=f"{kind} accum={accum}", n=n, calls_per_step=calls, bytes_per_step=st["bytes"] / K,
                   formula=formula / K)

# --- 2. overlap: the first bucket's all-reduce is issued before backward finishes -----------------
for kind in ("bucketed", "naive"):
    dp = make(kind)
    trace.clear()
    dp.forward_backward(*dp.local_batch(*batch(0)))
    names = [(e["name"], e["args"]) for e in trace.events()]   # in the order they were recorded
    end_of_backward = names.index(("backward", {"mb": 0}))   # one micro-batch: its backward span
    if kind == "bucketed":
        issued = [i for i, (nm, a) in enumerate(names) if nm == "dp.issue_bucket"]
        assert len(issued) == len(dp.buckets) and names[issued[0]][1]["bucket"] == 0
        assert issued[0] < end_of_backward, f"bucket 0 issued after backward finished: {names}"
        during = sum(i < end_of_backward for i in issued)
        if rank == 0:
            report(case="overlap", issued_during_backward=during, buckets=len(issued))
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
    expect_error(ValueError, lambda: dp.local_batch(*data.get_batch(tokens, n + 1, cfg.block_size, SEED, 0)),
                 f"does not divide by the data-parallel size {n}")
    other = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=8, n_layer=1 + (rank == n - 1),
                              n_head=4, n_embd=32)
    expect_error(ValueError, lambda: DataParallel(gpt.GPT(other, seed=0)), "different model than rank 0",
                 f"ranks [{n - 1}]")
expect_error(ValueError, lambda: make("bucketed", accum=2).local_batch(*data.get_batch(
    tokens, 3 * n, cfg.block_size, SEED, 0)), "does not split into 2 micro-batches")
expect_error(ValueError, lambda: DataParallel(gpt.GPT(cfg), bucket_cap_mb=0), "bucket caps must be > 0")
if rank == 0:
    report(case="errors and replica sync", n=n)
