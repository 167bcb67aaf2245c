"""The GPU path's wrong-result defects, on device arrays (strict CuPy stand-in, lazy streams).

    PDIST_DEVICE=gpu STRICT_CUPY_LAZY=1 PYTHONPATH=tests/strict_cupy:. mpiexec -n 4 \\
        python tests/workers/gpu_standin_cases.py

One launch of 4 ranks runs every case on the world group (n = 4) and on pairs split from
it (n = 2), over the transport the environment picks (PDIST_GPU_TRANSPORT=nccl|mpi-host):

* ddp: DataParallel with bucket caps small enough for >= 8 buckets equals one process
  (float64, rtol 1e-9: losses and every parameter), for 2 steps;
* avg: op="avg" (and "sum") of float16 and bfloat16 in all_reduce (blocking and async),
  reduce_scatter (uneven chunks) and reduce give the CPU path's bits: Σ_q fp32(x_q) in rank
  order, ÷ n, rounded once;
* bf16: all_gather, broadcast, all_to_all and isend/irecv of bfloat16 arrays move the bits;
* p2p: the user's blocking send matches an irecv, and isend a blocking recv;
* comm: all_reduce, reduce_scatter, all_gather (mpi, naive, ring) and broadcast (mpi, naive,
  tree) of float64 device arrays at sizes 0, 1, 7, 1001 against NumPy; async avg; a NumPy
  collective stays on the host; 1F1B and interleaved (v=2) pipelines on the world whose
  activations (256 x 128 float32, 128 KiB) exceed the rendezvous size the test sets
  (STRICT_CUPY_RENDEZVOUS_BYTES=65536: a lone send blocks until matched) finish, finite;
* identity: the GPU is named by PCI bus id (CUDA_VISIBLE_DEVICES maps index 0 differently);
* lazy: work was really queued, and no buffer was dropped while queued (poisoned); host
  staging copied through pinned buffers.

Each case reports (pdist.testing.report) on rank 0; a failed check fails the launch.
``argv[1]``, optional: the cases to run, comma-separated (default all)."""
import os
import sys

import ml_dtypes
import numpy as np

import cupy
from pdist import comm, data
from pdist.course import lesson
from pdist.engine.backend import is_device_array, set_default_dtype, to_numpy
from pdist.models import gpt
from pdist.parallel import DataParallel, Local
from pdist.testing import report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
pair = world.split(world.rank // 2, name="pair")
GROUPS = [pair, world]
BF16 = np.dtype(ml_dtypes.bfloat16)
K, B, SEED = 2, 8, 5
transport = {"NCCLBackend": "nccl", "MPIHostBackend": "mpi-host"}[type(world._device_backend()).__name__]
CASES = sys.argv[1].split(",") if len(sys.argv) > 1 else ["ddp", "avg", "bf16", "comm", "p2p", "identity"]


def say(case, **kw):
    if world.rank == 0:
        report(case=case, transport=transport, **kw)


# --- ddp: >= 8 buckets, polled during backward (host staging's copy back), equal to one process
tokens, tok = data.char_dataset(20_000)
cfg = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=8, n_layer=2, n_head=2, n_embd=16)
ref_losses, ref_state = lesson.train_reference(cfg, SEED, K, B, tokens) if "ddp" in CASES else (None, None)
for g in GROUPS if "ddp" in CASES else ():
    dp = DataParallel(Local(gpt.GPT(cfg, seed=SEED)), group=g, bucket_cap_mb=4 / 1024, first_bucket_cap_mb=1 / 1024)
    assert len(dp.buckets) >= 8, len(dp.buckets)
    losses = train(dp, lesson.make_adamw(dp.parameters()), data.batch_fn(tokens, B, cfg.block_size, SEED), K)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9, atol=0, err_msg=f"ddp n={g.size} losses")
    state = dp.module.state_dict() if hasattr(dp, "module") else dp.inner.module.state_dict()
    worst = 0.0
    for name, ref in ref_state.items():
        got = to_numpy(getattr(state[name], "data", state[name]))
        ref = to_numpy(getattr(ref, "data", ref))
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12, err_msg=f"ddp n={g.size} {name}")
        worst = max(worst, float(np.max(np.abs(got - ref))))
    say("ddp", n=g.size, buckets=len(dp.buckets), max_abs_diff=worst)


# --- avg / sum of 2-byte floats: the CPU path's bits
def inputs(size, dtype, g):
    rng = [np.random.default_rng([q, size, 11]) for q in range(g.size)]
    return [(r.standard_normal(size) * 3).astype(np.float32).astype(dtype) for r in rng]


def expect(xs, op):
    acc = np.zeros(xs[0].shape, np.float32)
    for x in xs:                                   # rank order, fp32, rounded once
        acc += x.astype(np.float32)
    if op == "avg":
        acc /= len(xs)
    return acc.astype(xs[0].dtype)


def same_bits(got, want, what):
    got = to_numpy(got)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint16), want.view(np.uint16)), \
        f"{what}: got {got[:4].astype(np.float32)} want {want[:4].astype(np.float32)}"


for g in GROUPS if "avg" in CASES else ():
    for dtype in (np.dtype(np.float16), BF16):
        for op in ("avg", "sum"):
            xs = inputs(7, dtype, g)
            want = expect(xs, op)
            x = cupy.asarray(xs[g.rank])
            g.all_reduce(x, op=op)
            same_bits(x, want, f"all_reduce {op} {dtype} n={g.size}")
            x = cupy.asarray(xs[g.rank])
            w = g.all_reduce(x, op=op, async_op=True)
            w.wait()
            same_bits(x, want, f"async all_reduce {op} {dtype} n={g.size}")
            a, b = comm.chunk_bounds(7, g.size)[g.rank]
            out = cupy.empty(b - a, dtype)
            g.reduce_scatter(out, cupy.asarray(xs[g.rank]), op=op)
            same_bits(out, want[a:b], f"reduce_scatter {op} {dtype} n={g.size}")
            x = cupy.asarray(xs[g.rank])
            g.reduce(x, dst=g.size - 1, op=op)
            same_bits(x, want if g.rank == g.size - 1 else xs[g.rank], f"reduce {op} {dtype} n={g.size}")
    say("avg", n=g.size, dtypes=["float16", "bfloat16"], ops=["avg", "sum"])

# --- bf16 collectives move the bits
for g in GROUPS if "bf16" in CASES else ():
    n, r = g.size, g.rank
    xs = inputs(4 * n, BF16, g)
    full = cupy.empty(4 * n * n, BF16)
    g.all_gather(full, cupy.asarray(xs[r]))
    same_bits(full, np.concatenate(xs), f"bf16 all_gather n={n}")
    x = cupy.asarray(xs[r])
    g.broadcast(x, src=n - 1)
    same_bits(x, xs[n - 1], f"bf16 broadcast n={n}")
    out = cupy.empty(4 * n, BF16)
    g.all_to_all(out, cupy.asarray(xs[r]))
    same_bits(out, np.concatenate([xs[q][4 * r:4 * r + 4] for q in range(n)]), f"bf16 all_to_all n={n}")
    blk = lambda p, q: (np.arange((p + q) % 3 * 2).reshape(-1, 2) + 16 * p + 4 * q).astype(BF16)  # noqa: E731
    for alg in ("mpi", "pairwise"):                  # all_to_all_v: rows r -> q = (r + q) % 3, zeros too
        out = cupy.empty((sum((p + r) % 3 for p in range(n)), 2), BF16)
        g.all_to_all_v(out, cupy.asarray(np.concatenate([blk(r, q) for q in range(n)])),
                       [(r + q) % 3 for q in range(n)], [(p + r) % 3 for p in range(n)], algorithm=alg)
        same_bits(out, np.concatenate([blk(p, r) for p in range(n)]), f"bf16 all_to_all_v {alg} n={n}")
    got = cupy.empty(4 * n, BF16)
    works = g.batch_isend_irecv([("send", cupy.asarray(xs[r]), (r + 1) % n, 0), ("recv", got, (r - 1) % n, 0)])
    for w in works:
        w.wait()
    same_bits(got, xs[(r - 1) % n], f"bf16 isend/irecv n={n}")
    say("bf16", n=n)

# --- comm: every collective x algorithm on float64 device arrays, against NumPy
def collectives(g):
    n, r = g.size, g.rank
    for size in (0, 1, 7, 1001):
        ins = [np.random.default_rng([q, size]).standard_normal(size) for q in range(n)]
        ref = np.sum(ins, axis=0) if size else np.zeros(0)
        a, b = comm.chunk_bounds(size, n)[r]
        for alg in ("mpi", "naive", "ring"):
            x = cupy.asarray(ins[r])
            g.all_reduce(x, algorithm=alg)
            out = cupy.empty(b - a)
            g.reduce_scatter(out, cupy.asarray(ins[r]), algorithm=alg)
            full = cupy.zeros(size)
            g.all_gather(full, cupy.asarray(ref[a:b]), algorithm=alg)
            assert is_device_array(x) and is_device_array(full)
            for got, want in ((x, ref), (out, ref[a:b]), (full, ref)):
                np.testing.assert_allclose(to_numpy(got), want, rtol=1e-12, atol=1e-12,
                                           err_msg=f"{alg} size {size} n={n}")
        for alg in ("mpi", "naive", "tree"):
            x = cupy.asarray(ins[r])
            g.broadcast(x, src=n - 1, algorithm=alg)
            np.testing.assert_array_equal(to_numpy(x), ins[n - 1], err_msg=f"broadcast {alg} n={n}")
    avg = cupy.full(10, float(r + 1))
    g.all_reduce(avg, op="avg", async_op=True).wait()
    np.testing.assert_array_equal(to_numpy(avg), np.full(10, (n + 1) / 2))
    h = np.arange(5.0) * (r + 1)                 # a NumPy collective stays on the host on a GPU backend
    g.all_reduce(h, algorithm="ring")
    assert isinstance(h, np.ndarray) and np.allclose(h, np.arange(5.0) * n * (n + 1) / 2)


def pipelines(g, rows=256, H=128):
    """rows x H float32 activations (128 KiB) above the rendezvous size: lone sends block."""
    from pdist import nn
    from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel
    m = 2 * g.size
    limit = int(os.environ.get("STRICT_CUPY_RENDEZVOUS_BYTES", 4 << 20))
    assert rows * H * 4 > limit, f"activations of {rows * H * 4} bytes do not exceed the rendezvous size {limit}"
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        layers = [nn.Linear(H, H, bias=False) for _ in range(g.size * v)]
        pipe = PipelineParallel(nn.Sequential(*layers), g, schedule, m, v,
                                act_shape=lambda k, rows_, x: (rows_, H), loss_fn=nn.mse_loss)
        xb = np.random.default_rng(0).standard_normal((rows * m, H)).astype(np.float32)
        loss = pipe.forward_backward(xb, np.zeros((rows * m, H), np.float32))
        assert np.isfinite(loss), loss
        assert not pipe._recvs and not pipe._stash


if "comm" in CASES:
    for g in GROUPS:
        collectives(g)
    pipelines(world)
    say("comm", n=[g.size for g in GROUPS])

# --- the user's blocking send/recv and isend/irecv share a communicator
x = cupy.arange(5, dtype=cupy.float64) * (pair.rank + 1)
y = cupy.zeros(5, cupy.float64)
if "p2p" not in CASES:
    pass
elif pair.rank == 0:                         # two different messages: they must arrive in order
    pair.send(x, 1)
    pair.isend(x * 2, 1).wait()
else:
    pair.irecv(y, 0).wait()
    np.testing.assert_array_equal(to_numpy(y), np.arange(5.0), err_msg="send -> irecv")
    pair.recv(y, 0)
    np.testing.assert_array_equal(to_numpy(y), np.arange(5.0) * 2, err_msg="isend -> recv")
if "p2p" in CASES:
    say("p2p", n=2)

# --- the GPU's identity is its PCI bus id
if "identity" in CASES:
    from pdist.comm import gpu_transport
    os.environ["CUDA_VISIBLE_DEVICES"] = "7,6,5,4,3,2,1,0"      # index r is physical GPU 7 - r
    host, bus = gpu_transport.gpu_identity()
    assert bus == f"0000:{7 - world.rank:02x}:00.0", bus
    say("identity", bus=bus)

# --- lazy streams were on, and nothing was dropped while queued
from cupy.cuda import _lazy  # noqa: E402
if os.environ.get("STRICT_CUPY_LAZY") == "1" and transport == "nccl":
    assert _lazy.STATS["queued"] > 0, _lazy.STATS
assert _lazy.STATS["poisoned"] == 0, _lazy.STATS
if transport == "mpi-host":
    import cupyx
    assert cupyx.pinned_allocs[0] > 0, "host staging did not stage through pinned buffers"
say("lazy", **_lazy.STATS)
print(f"OK rank {world.rank} {transport}", flush=True)
