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

# --- 1b. the synchronized gradient itself, which AdamW's losses cannot show (m / sqrt(v) hides a
#     scale): after one step's backward and sync every p.grad is one process's mean gradient. The
#     MoE model (16 experts, top 2, few tokens) leaves experts unused in a pass on some rank, so
#     their gradients reach the bucket only in finish_grad_sync (``late``), not in the hook
MOE = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=4, n_layer=1, n_head=2, n_embd=16,
                        n_expert=16, expert_top_k=2, router_aux_loss_coef=0.0)   # no aux: rows separate
late = 0
for mcfg, rows in ((cfg, B), (MOE, 4 * n)):
    xy = data.get_batch(tokens, rows, mcfg.block_size, SEED, 0)
    ref = gpt.GPT(mcfg, seed=SEED)
    _, ref_loss = ref(*xy)
    ref_loss.backward()
    want = {name: to_numpy(q.grad) if q.grad is not None else 0 * to_numpy(q.data)
            for name, q in ref.named_parameters()}
    for kind in ("naive", "bucketed"):
        for accum in (1, 2):
            dp = (DataParallelNaive(Local(gpt.GPT(mcfg, seed=SEED), microbatches=accum)) if kind == "naive" else
                  DataParallel(Local(gpt.GPT(mcfg, seed=SEED), microbatches=accum), **CAPS))
            if kind == "bucketed":
                sync = dp.finish_grad_sync

                def counted(dp=dp, sync=sync, accum=accum):
                    global late
                    late += sum(b.ready.get(id(q), 0) < accum for b in dp.buckets for q in b.params)
                    sync()
                dp.finish_grad_sync = counted
            dp.forward_backward(*dp.local_batch(*xy))
            for name, q in dp.module.named_parameters():
                w = want[name]
                np.testing.assert_allclose(to_numpy(q.grad), w, rtol=1e-9, atol=1e-12 * np.abs(w).max(),
                                           err_msg=f"{kind} accum={accum} n_expert={mcfg.n_expert}: {name}.grad")
assert sum(world.all_gather_object(late)) > 0, \
    "no gradient reached its bucket after backward: the MoE case no longer tests that path"

# --- 2. overlap: the first bucket's all-reduce is issued before backward finishes -----------------
for kind in ("bucketed", "naive"):
    dp = make(kind)
    trace.clear()
    dp.forward_backward(*dp.local_batch(*batch(0)))
    evs = trace.events()
    bwd = next(e for e in evs if (e["name"], e["args"]) == ("backward", {"mb": 0}))   # one micro-batch's backward
    ars = sorted(e["start"] for e in evs if e["name"] == "all_reduce" and e["args"].get("group") == dp.group.name)
    if kind == "bucketed":      # each bucket's all-reduce starts (is issued) when backward completes it
        assert len(ars) == len(dp.buckets), (len(ars), len(dp.buckets))
        assert ars[0] < bwd["end"], f"bucket 0 issued after backward finished: {ars[0]} >= {bwd['end']}"
        during = sum(t < bwd["end"] for t in ars)
        if rank == 0:
            report(case="overlap", issued_during_backward=during, buckets=len(ars))
    else:   # the control: the naive one communicates only after backward
        assert ars and ars[0] > bwd["end"]

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
