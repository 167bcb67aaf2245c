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
gathered) and a last line ``WORKER {json}`` (with rank 0's device memory per step:
pdist/measure/device_memory.py, so the first collective's NCCL buffers show as
``outside_pool_bytes``); exit 1 when a case failed. The transport is the
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

from pdist import comm  # noqa: E402
from pdist.course import lesson  # noqa: E402
from pdist.engine import attention_device, backend  # noqa: E402
from pdist.engine.backend import set_default_dtype, to_device, to_numpy  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.models.llama import Llama  # noqa: E402

from gpu_cases import SEED, STEPS, _close, _first, batch, gpt_cfg, llama_cfg  # noqa: E402


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


# ------------------------------------------------------------------ steps c, d (bench/gpu_cases.py)
def step_c(world, pipe_rows):
    from gpu_cases import _big_pipeline_case, _layout_case
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


def step_d(world):
    from gpu_cases import _precision_case
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
    from pdist.measure.device_memory import DeviceMemory
    rows, memory = [], {}
    for s in a.steps.split(","):
        with DeviceMemory() as dm:       # the step's device memory: pool, and what NCCL/cuBLAS took beside it
            rows += run_cases(world, s, makers[s]())
        memory[s] = dm.row()
    ok = all(r["ok"] for r in rows) and bool(rows)
    if world.rank == 0:
        from pdist.comm import gpu_transport
        transport = os.environ.get("PDIST_GPU_TRANSPORT") or "auto"
        print("WORKER " + json.dumps({"ranks": world.size, "transport": transport, "ok": ok, "cases": rows,
                                      "nccl": gpu_transport.version_str(gpu_transport.version()),
                                      "device_memory_rank0": memory}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
