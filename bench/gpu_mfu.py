"""GPT-2-small step MFU on one GPU, per precision, against the matmul ceiling measured in the
same run and against the device's spec peak.

    python bench/gpu_mfu.py                          # fp32, tf32 and bf16; 12 x 12 x 768, T 1024, B 8
    python bench/gpu_mfu.py --precision bf16 --steps 20

Per precision, forward + backward + AdamW of a GPT-2-small-shaped model (float32 activations):

    fp32   float32 GEMMs, TF32 off (``attention_device.allow_tf32(False)``)
    tf32   float32 GEMMs on TF32 tensor cores (``allow_tf32(True)``, as CUPY_TF32=1)
    bf16   bf16 mixed precision (bf16 weights, fp32 masters): every Linear is a bf16 GEMM
           with fp32 accumulate (``attention_device.low_matmul``); attention's products TF32

timed with ``synchronize()`` before each clock read (median of ``--steps`` after 2 warm-up
steps). FLOP convention (PaLM, Chowdhery et al., 2022, app. B): per token
6 N + 12 L T d, N every parameter (the tied embedding once), L layers, d width, T context:
the 6N of the GEMMs forward and backward plus attention's QK^T and PV at full T x T (the
causal skipping is not credited). ``model TFLOP/s`` = that x tokens / step time;

    MFU (measured) = model FLOP/s / the ceiling: square ``--matmul-n`` GEMMs in the same
                     dtype and compute type (fp32, tf32 or bf16), timed in this run
    MFU (spec)     = model FLOP/s / the data sheet's dense peak of the device (H100/H200
                     SXM: fp32 67, tf32 495, bf16 989 TFLOP/s; None for devices not listed)

Peak device memory per precision comes from the MemoryHook (pdist/measure/device_memory.py).
PASS when the best MFU against the measured ceiling is >= ``--target`` (35%). Prints
``MFU {json}`` last. Without CuPy or a CUDA device: prints "no GPU" and exits 2."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SPEC_TFLOPS = {"H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
               "H100": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4},
               "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}}


def gpu_count():
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no libcudart
        return 0


def device_name():
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0).get("name", b"?")
    return name.decode() if isinstance(name, bytes) else str(name)


def spec_peak(name, prec):
    for key, table in SPEC_TFLOPS.items():
        if key in name:
            return table[prec] * 1e12
    return None


def ceiling(prec, n, reps=10):
    """FLOP/s of square n x n GEMMs in the precision's dtype and compute type."""
    from pdist.engine import attention_device as D
    from pdist.engine.backend import bfloat16, synchronize, xp
    dt = bfloat16 if prec == "bf16" else xp.float32
    a, b = xp.ones((1, n, n), dtype=dt), xp.ones((1, n, n), dtype=dt)
    out = xp.empty((1, n, n), dtype=xp.float32 if prec == "bf16" else dt)
    D.gemm(a, b, out)
    synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        D.gemm(a, b, out)
    synchronize()
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def step_seconds(a, prec):
    """(median step seconds, parameter count, peak device bytes) of one precision."""
    import numpy as np
    from pdist.course import lesson
    from pdist.engine import precision
    from pdist.engine.backend import synchronize, to_device
    from pdist.measure.memory import PeakMemory
    from pdist.models import gpt
    from pdist.parallel import Local, MixedPrecision
    cfg = gpt.GPTConfig(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                        n_embd=a.n_embd, dropout=0.0, dtype="float32")
    model = gpt.GPT(cfg, 0)
    n_params = sum(int(q.data.size) for q in model.parameters())
    if prec == "bf16":
        model = MixedPrecision(Local(precision.cast_module(model, "bf16")), "bf16")
    else:
        model = Local(model)
    opt = lesson.make_adamw(model.parameters())
    rng = np.random.default_rng(0)
    x, y = (to_device(rng.integers(0, a.vocab, (a.batch_size, a.block_size))) for _ in range(2))

    def step():
        model.forward_backward(x, y)
        opt.step()

    for _ in range(2):  # warm-up: kernels compiled, pool and optimizer state allocated
        step()
    synchronize()
    times = []
    with PeakMemory() as pk:
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            synchronize()  # the step's device work is done
            times.append(time.perf_counter() - t0)
    return float(np.median(times)), n_params, pk.peak_bytes


def measure(a, prec, name):
    from pdist.engine import attention_device as D
    D.allow_tf32(prec != "fp32")
    step_s, n_params, peak = step_seconds(a, prec)
    ceil = ceiling(prec, a.matmul_n)
    T, L, d = a.block_size, a.n_layer, a.n_embd
    tokens = a.batch_size * T
    model_flops = (6.0 * n_params + 12.0 * L * T * d) * tokens / step_s
    spec = spec_peak(name, prec)
    return {"precision": prec, "step_s": step_s, "tokens_per_s": tokens / step_s, "model_tflops": model_flops / 1e12,
            "ceiling_tflops": ceil / 1e12, "mfu_measured": model_flops / ceil,
            "spec_tflops": None if spec is None else spec / 1e12,
            "mfu_spec": None if spec is None else model_flops / spec, "peak_device_bytes": peak,
            "params": n_params}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", default="fp32,tf32,bf16", help="comma-separated: fp32, tf32, bf16")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304, help="GPT-2's 50257 padded to a multiple of 64")
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--matmul-n", type=int, default=8192, help="side of the ceiling's square GEMMs")
    p.add_argument("--target", type=float, default=0.35)
    a = p.parse_args()
    if gpu_count() < 1:
        print("gpu_mfu: no GPU: CuPy with a CUDA device is needed (pip install 'pdist[gpu]'); nothing measured")
        return 2
    from pdist.engine import backend
    backend.use_device("gpu")
    backend.set_default_dtype("float32")
    name = device_name()
    print(f"gpu_mfu: {name}; {a.n_layer} layers x {a.n_head} heads x {a.n_embd} wide, vocab {a.vocab}, "
          f"B {a.batch_size}, T {a.block_size}; FLOPs per token 6N + 12 L T d (PaLM)", flush=True)
    rows = []
    for prec in a.precision.split(","):
        r = measure(a, prec, name)
        rows.append(r)
        spec = "n/a" if r["mfu_spec"] is None else f"{100 * r['mfu_spec']:.1f}% of spec {r['spec_tflops']:.0f}"
        print(f"gpu_mfu: {prec:4s} step {r['step_s'] * 1e3:8.1f} ms, {r['tokens_per_s']:10,.0f} tokens/s, "
              f"{r['model_tflops']:6.1f} TFLOP/s; MFU {100 * r['mfu_measured']:5.1f}% of the measured "
              f"{r['ceiling_tflops']:.1f} TFLOP/s ceiling, {spec}; peak {r['peak_device_bytes'] / 2 ** 30:.2f} GiB",
              flush=True)
    best = max(r["mfu_measured"] for r in rows)
    ok = best >= a.target
    print(f"{'PASS' if ok else 'FAIL'}: gpu_mfu best MFU {100 * best:.1f}% (target {100 * a.target:.0f}%)")
    print("MFU " + json.dumps({"device": name, "flop_convention": "6N + 12 L T d per token (PaLM app. B)",
                               "rows": rows, "best_mfu_measured": best, "target": a.target, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
