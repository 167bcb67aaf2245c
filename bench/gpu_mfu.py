"""GPT-2-small step time and MFU on one GPU, against the matmul ceiling measured in the same run.

    CUPY_TF32=1 python bench/gpu_mfu.py            # 12 layers, 12 heads, 768 wide, T 1024, B 8

Times forward + backward + AdamW of a GPT-2-small-shaped model (float32; TF32 matmuls where
CUPY_TF32=1) with ``synchronize()`` before each clock read, then measures the device's float32
matmul ceiling (a loop of large ``xp.matmul``, the same TF32 setting), and prints

    MFU = 6 * params * tokens_per_step / step_seconds / ceiling_flops

(the usual 6N estimate; attention's own FLOPs are left out, so MFU is slightly understated).
PASS when MFU >= 35% (--target). Without CuPy or a CUDA device: prints "no GPU" and exits 2.
Exit 1 on FAIL."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def gpu_count():
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no libcudart
        return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304, help="GPT-2's 50257 padded to a multiple of 64")
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--matmul-n", type=int, default=8192, help="side of the ceiling's square matmuls")
    p.add_argument("--target", type=float, default=0.35)
    a = p.parse_args()
    if gpu_count() < 1:
        print("gpu_mfu: no GPU: CuPy with a CUDA device is needed (pip install 'pdist[gpu]'); nothing measured")
        return 2

    import numpy as np
    from pdist.engine import backend
    from pdist.models import gpt
    from pdist.course import lesson
    from pdist.engine.backend import synchronize, xp
    backend.use_device("gpu")
    backend.set_default_dtype("float32")

    cfg = gpt.GPTConfig(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                        n_embd=a.n_embd, dropout=0.0, dtype="float32")
    model = gpt.GPT(cfg, 0)
    opt = lesson.make_adamw(model.parameters())
    n_params = sum(int(q.data.size) for q in model.parameters())
    rng = np.random.default_rng(0)
    B, T = a.batch_size, a.block_size
    x = backend.to_device(rng.integers(0, a.vocab, (B, T)))
    y = backend.to_device(rng.integers(0, a.vocab, (B, T)))

    def step():
        model.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()

    for _ in range(2):  # warm-up: kernels compiled, memory pool and optimizer state allocated
        step()
    synchronize()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        synchronize()  # the step's device work is done
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))

    n = a.matmul_n  # the ceiling: the same dtype and TF32 setting, large square matmuls
    m1 = xp.ones((n, n), dtype=xp.float32) / n
    m2 = xp.ones((n, n), dtype=xp.float32)
    out = xp.empty((n, n), dtype=xp.float32)
    xp.matmul(m1, m2, out=out)
    synchronize()
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        xp.matmul(m1, m2, out=out)
    synchronize()
    ceiling = 2.0 * n ** 3 * reps / (time.perf_counter() - t0)

    tokens = B * T
    achieved = 6.0 * n_params * tokens / step_s
    mfu = achieved / ceiling
    ok = mfu >= a.target
    print(f"gpu_mfu: {a.n_layer} layers x {a.n_head} heads x {a.n_embd} wide, vocab {a.vocab}, B {B}, T {T}: "
          f"{n_params / 1e6:.1f} M params, TF32 {os.environ.get('CUPY_TF32', '0')}")
    print(f"gpu_mfu: step {step_s * 1e3:.1f} ms (median of {a.steps}), {tokens / step_s:,.0f} tokens/s, "
          f"{achieved / 1e12:.1f} TFLOP/s by 6N")
    print(f"gpu_mfu: matmul ceiling {ceiling / 1e12:.1f} TFLOP/s (float32, n {n}); "
          f"MFU {100 * mfu:.1f}% (target {100 * a.target:.0f}%)")
    print(f"{'PASS' if ok else 'FAIL'}: gpu_mfu MFU {100 * mfu:.1f}%")
    from machine import report
    report("gpu_mfu", {"step_s": step_s, "tflops": achieved / 1e12, "ceiling_tflops": ceiling / 1e12,
                       "mfu": mfu, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
