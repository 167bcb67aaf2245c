"""The device checks of bench/gpu_acceptance.sh, one launch per step, every case in a loop.

    PDIST_DEVICE=gpu python bench/gpu_worker.py --steps a                 # one process
    PDIST_DEVICE=gpu mpiexec -n 4 python bench/gpu_worker.py --steps b,c,d

Steps (the issue's letters; every equality is against NumPy or one process on the same
global batch, shard by shard where the state is sharded):

    a  one process: GPT and Llama (grouped-query) on CuPy equal NumPy in float64, rtol 1e-9:
       the loss of every step, every gradient of the first backward, every parameter and
       AdamW's m and v after the last step. Attention runs in several query blocks on the
       device (``attention_device.DEVICE_QBLOCK`` set small), one on the host.
    b  collectives on device arrays at this launch's size: all_reduce (sum, avg),
       reduce_scatter, all_gather, for float32/float64 x the mpi, naive and ring algorithms,
       and float16/bfloat16 (sum and avg: summed in fp32 in rank order, rounded once).
    c  DDP with >= 8 buckets, ZeRO-3 and 1F1B (pp = ranks, 4 micro-batches) equal one
       process in float64, rtol 1e-9 (losses, full_state_dict, Adam's m and v by piece);
       1F1B and interleaved pipelines of Linears whose activations (``--pipe-rows`` x 1024
       float64, 8 MiB) exceed NCCL's 4 MiB buffer, where a lone send blocks: they finish,
       with one process's loss.
    d  bf16 and fp16 mixed precision (DDP) equal one process in the same precision
       (``MixedPrecision(Local(..., microbatches=N))``): fp32 masters and Adam's state
       to rtol 1e-6 (bitwise where the reduction keeps rank order), losses rtol 1e-6.

Rank 0 prints ``CASE <step> <name> PASS|FAIL <detail>`` for each case (every rank's verdict
gathered) and a last line ``WORKER {json}``; exit 1 when a case failed. The transport is the
launch's (``PDIST_GPU_TRANSPORT``, or the automatic choice); the CI runs this file on the
strict stand-in (tests/test_gpu_acceptance.py), the script on a GPU."""
import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pdist import comm, data  # noqa: E402
from pdist.course import lesson  # noqa: E402
from pdist.engine import attention_device, backend, precision  # noqa: E402
from pdist.engine.backend import set_default_dtype, to_device, to_numpy  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.models.llama import Llama, LlamaConfig  # noqa: E402

B, T, SEED, STEPS, VOCAB = 8, 16, 3, 3, 96
TOL = dict(rtol=1e-9, atol=1e-12)
tokens, _ = data.char_dataset(20_000)
batch = data.batch_fn(tokens, B, T, SEED, VOCAB)


def gpt_cfg(n_layer=2):
    return lesson.gpt_config(VOCAB, dtype="float64", block_size=T, n_layer=n_layer, n_head=4, n_embd=32)


def llama_cfg():
    return LlamaConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                       intermediate_size=48, dtype="float64")


def _close(name, got, want, **tol):
    """None when equal to ``tol``, else a line naming ``name`` and the largest difference."""
    got, want = to_numpy(got).astype(np.float64), to_numpy(want).astype(np.float64)
    if got.shape == want.shape and np.allclose(got, want, **(tol or TOL)):
        return None
    diff = np.abs(got - want).max() if got.shape == want.shape else f"shape {got.shape} vs {want.shape}"
    return f"{name}: max |diff| {diff}"


def _first(problems):
    problems = [p for p in problems if p]
    return (not problems, problems[0] if problems else "")


# ------------------------------------------------------------------ step a
def _train_one(device, cls, cfg):
    """K AdamW steps in one process on ``device``: (losses, first grads, state, m, v) as NumPy."""
    backend.use_device(device)
    model = cls(cfg, SEED)
    opt = lesson.make_adamw(model.parameters())
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = (to_device(a) for a in batch(step))
        model.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        if step == 0:
            grads = {n: to_numpy(p.grad) for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(to_numpy(loss.data)))
    named = dict(model.named_parameters())
    state = {n: to_numpy(a) for n, a in model.state_dict().items()}
    mv = {f"{n}.{k}": to_numpy(opt.state[id(p)][k]) for n, p in named.items() for k in ("exp_avg", "exp_avg_sq")}
    return losses, grads, state, mv


def _one_device_case(cls, cfg):
    qblock = attention_device.DEVICE_QBLOCK
    attention_device.DEVICE_QBLOCK = 4  # T 16: four query blocks on the device, causal skipping on
    try:
        host = _train_one("cpu", cls, cfg)
        dev = _train_one("gpu", cls, cfg)
    finally:
        attention_device.DEVICE_QBLOCK = qblock
        backend.use_device("gpu")
    probs = [_close("losses", dev[0], host[0])]
    for part, label in ((1, "grad"), (2, "param"), (3, "adam")):
        probs += [_close(f"{label} {k}", dev[part][k], host[part][k]) for k in host[part]]
    return _first(probs)


def step_a(world):
    for name, cls, cfg in (("gpt2", GPT, gpt_cfg()), ("llama (grouped-query)", Llama, llama_cfg())):
        yield f"{name} cupy == numpy float64 (fwd, bwd, AdamW)", lambda c=cls, f=cfg: _one_device_case(c, f)


# ------------------------------------------------------------------ step b
def _inputs(n, size, dt):
    return [(np.random.default_rng([q, size]).standard_normal(size) * 10).astype(dt) for q in range(n)]


def _reference(ins, op, dt):
    """fp32 (fp64 for float64) sum in rank order, divided for avg, rounded once to ``dt``."""
    acc = np.float64 if np.dtype(dt) == np.float64 else np.float32
    s = ins[0].astype(acc)
    for a in ins[1:]:
        s = s + a.astype(acc)
    return (s / len(ins) if op == "avg" else s).astype(dt)


def _collectives(g, dt, alg, size):
    xp = backend.xp
    n, r = g.size, g.rank
    ins = _inputs(n, size, dt)
    a, b = comm.chunk_bounds(size, n)[r]
    tol = {"float64": dict(rtol=1e-12, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-4)}.get(
        np.dtype(dt).name, dict(rtol=0, atol=0))                      # 2-byte floats: one rounding, exact
    probs = []
    for op in ("sum", "avg"):
        x = xp.asarray(ins[r])
        g.all_reduce(x, op=op, algorithm=alg)
        probs.append(_close(f"all_reduce {op}", x, _reference(ins, op, dt), **tol))
    out = xp.empty(b - a, dt)
    g.reduce_scatter(out, xp.asarray(ins[r]), algorithm=alg)
    probs.append(_close("reduce_scatter", out, _reference(ins, "sum", dt)[a:b], **tol))
    full = xp.zeros(size, dt)
    g.all_gather(full, xp.asarray(ins[r][a:b]), algorithm=alg)
    want = np.concatenate([ins[q][slice(*comm.chunk_bounds(size, n)[q])] for q in range(n)])
    probs.append(_close("all_gather", full, want, rtol=0, atol=0))
    backend.synchronize()
    return probs


def step_b(world, sizes):
    for dt in (np.float32, np.float64):
        for alg in ("mpi", "naive", "ring"):
            yield f"{np.dtype(dt).name} {alg}", lambda d=dt, a=alg: _first(
                [p for size in sizes for p in _collectives(world, d, a, size)])
    for dt in (np.float16, backend.bfloat16):
        yield f"{np.dtype(dt).name} (fp32 sum, one rounding)", lambda d=dt: _first(
            [p for size in sizes for p in _collectives(world, d, None, size)])


# ------------------------------------------------------------------ steps c, d
def _reference_run(make_model, microbatches=1, wrap=None):
    from pdist.parallel import Local
    from pdist.training import train
    ref = Local(make_model(), microbatches=microbatches)
    ref = wrap(ref) if wrap else ref
    opt = lesson.make_adamw(ref.parameters())
    return ref, opt, train(ref, opt, batch, STEPS)


def _compare(model, opt, ref, ref_opt, losses, ref_losses, tol):
    from pdist.testing import check_shards
    pieces = {pc.name: pc for pc in ref.pieces()}
    same = lambda a, b: np.allclose(a, b, **tol)  # noqa: E731
    probs = [_close("losses", np.array(losses), np.array(ref_losses), **tol)]
    try:
        check_shards(model.sharded_state_dict(opt), ref.full_state_dict(),
                     lambda n, s: ref_opt.state[id(pieces[n].tensor)][s], same)
    except AssertionError as e:
        probs.append(f"shard {e}")
    full, want = model.full_state_dict(), ref.full_state_dict()
    probs += [_close(k, full[k], want[k], **tol) for k in want]
    return probs


def _layout_case(n, mesh_kw, kw):
    from pdist.parallel import DataParallel, parallelize
    from pdist.training import train
    n_layer = max(2, n) if "pp" in mesh_kw else 2
    model = parallelize(GPT(gpt_cfg(n_layer), SEED), comm.DeviceMesh(**mesh_kw), **kw)
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, STEPS)
    ref, ref_opt, ref_losses = _reference_run(lambda: GPT(gpt_cfg(n_layer), SEED))
    probs = _compare(model, opt, ref, ref_opt, losses, ref_losses, TOL)
    if "bucket_cap_mb" in kw:
        nb = len(model.find(DataParallel).buckets)
        probs.insert(0, None if nb >= 8 else f"only {nb} buckets (want >= 8)")
        probs.append(f"{nb} buckets")
    ok, detail = _first(probs[:-1] if "bucket_cap_mb" in kw else probs)
    return ok, detail or (probs[-1] if "bucket_cap_mb" in kw else "")


def _big_pipeline_case(world, schedule, v, rows, width):
    """A pipeline of n v Linears whose activations (rows x width float64) exceed NCCL's buffer,
    so a lone send blocks until matched: it must finish, with one process's loss."""
    from pdist import nn
    from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel
    n, m = world.size, 2 * world.size
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((rows * m, width)), np.zeros((rows * m, width))

    def layers():
        nn.manual_seed(7)
        return [nn.Linear(width, width, bias=False) for _ in range(n * v)]
    ref = nn.mse_loss(nn.Sequential(*layers())(to_device(x)), to_device(y))
    pipe = PipelineParallel(nn.Sequential(*layers()), world, schedule, m, v,
                            act_shape=lambda k, rows_, x_: (rows_, width), loss_fn=nn.mse_loss)
    loss = pipe.forward_backward(*pipe.local_batch(x, y))
    return _first([_close("loss", np.array(loss), to_numpy(ref.data))])


def step_c(world, pipe_rows):
    n = world.size
    caps = dict(bucket_cap_mb=4 / 1024, first_bucket_cap_mb=1 / 1024)   # 4 KiB buckets: 19 of them
    for name, mesh_kw, kw in (("DDP, >= 8 buckets", dict(dp=n), caps), ("ZeRO-3", dict(dp=n), dict(zero_stage=3)),
                              (f"1F1B pp={n}", dict(pp=n), dict(microbatches=4))):
        yield name, lambda m=mesh_kw, k=kw: _layout_case(n, m, k)
    if n > 1:
        mib = pipe_rows * 1024 * 8 / 2 ** 20
        for schedule, v in (("1f1b", 1), ("interleaved", 2)):
            yield f"{schedule} v={v}, {mib:g} MiB activations", \
                lambda s=schedule, k=v: _big_pipeline_case(world, s, k, pipe_rows, 1024)


def _precision_case(n, prec):
    from pdist.engine.grad_scaler import GradScaler
    from pdist.parallel import MixedPrecision, parallelize
    from pdist.training import train
    scaler = (lambda: GradScaler(init_scale=2.0 ** 8)) if prec == "fp16" else (lambda: None)
    model = parallelize(GPT(gpt_cfg(), SEED), comm.DeviceMesh(dp=n), precision=prec, scaler=scaler())
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, STEPS)
    ref, ref_opt, ref_losses = _reference_run(lambda: precision.cast_module(GPT(gpt_cfg(), SEED), prec),
                                              microbatches=n, wrap=lambda m: MixedPrecision(m, prec, scaler()))
    return _first(_compare(model, opt, ref, ref_opt, losses, ref_losses, dict(rtol=1e-6, atol=1e-9)))


def step_d(world):
    for prec in ("bf16", "fp16"):
        yield f"{prec} mixed precision DDP", lambda p=prec: _precision_case(world.size, p)


# ------------------------------------------------------------------ the loop
def run_cases(world, step, cases):
    """Run each (name, thunk) case; every rank's verdict gathered; rank 0 prints one CASE line
    per case. A case that raises is a FAIL with its exception; the next case still runs."""
    rows = []
    for name, thunk in cases:
        t0 = time.perf_counter()
        try:
            ok, detail = thunk()
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e} | {traceback.format_exc(limit=-2)!r}"
        verdicts = world.all_gather_object((ok, detail))
        ok = all(v[0] for v in verdicts)
        detail = "; ".join(f"rank {q}: {d}" for q, (o, d) in enumerate(verdicts) if not o) or detail
        rows.append({"step": step, "case": name, "ok": ok, "detail": detail[:500],
                     "seconds": round(time.perf_counter() - t0, 3)})
        if world.rank == 0:
            print(f"CASE {step} {name} {'PASS' if ok else 'FAIL'} {detail[:300]}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", default="a", help="comma-separated letters of a, b, c, d")
    p.add_argument("--sizes", default="0,1,7,1001", help="collective sizes (step b), comma-separated")
    p.add_argument("--pipe-rows", type=int, default=1024,
                   help="rows of step c's pipeline activations (x 1024 float64: 1024 rows = 8 MiB, above NCCL's 4 MiB)")
    a = p.parse_args()
    set_default_dtype("float64")
    backend.use_device("gpu")
    world = comm.init()
    sizes = [int(s) for s in a.sizes.split(",")]
    makers = {"a": lambda: step_a(world), "b": lambda: step_b(world, sizes), "c": lambda: step_c(world, a.pipe_rows),
              "d": lambda: step_d(world)}
    rows = []
    for s in a.steps.split(","):
        rows += run_cases(world, s, makers[s]())
    ok = all(r["ok"] for r in rows) and bool(rows)
    if world.rank == 0:
        from pdist.comm import gpu_transport
        transport = os.environ.get("PDIST_GPU_TRANSPORT") or "auto"
        print("WORKER " + json.dumps({"ranks": world.size, "transport": transport, "ok": ok, "cases": rows,
                                      "nccl": gpu_transport.version_str(gpu_transport.version())}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
