"""The NCCL check: all_reduce, all_gather, reduce_scatter on CuPy arrays (NCCL,
and the hand-built algorithms over NCCL send/recv) against NumPy references.

    python bench/gpu_check.py            # one rank, one GPU
    mpirun -n 2 python bench/gpu_check.py  # one rank per GPU (local_rank % n_gpus)

Prints SKIP and exits 0 where no GPU or no CuPy is present; PASS/FAIL otherwise
(non-zero exit on FAIL)."""
import sys

import numpy as np

from pdist.comm import gpu_transport


def main():
    if not gpu_transport.available():
        print("SKIP: gpu_check needs CuPy with NCCL and a CUDA device")
        return 0
    import cupy
    from pdist import comm
    from pdist.engine.backend import to_numpy
    g = comm.init(device="gpu")
    n, r = g.size, g.rank
    fails = []
    for dt in (np.float32, np.float64, np.int64):
        for size in (0, 1, 7, 1001, 1 << 20):
            ins = [(np.random.default_rng([q, size]).standard_normal(size) * 100).astype(dt) for q in range(n)]
            ref = np.sum(np.stack(ins).astype(np.float64), axis=0) if size else np.zeros(0)
            a, b = comm.chunk_bounds(size, n)[r]
            tol = 1e-4 if dt == np.float32 else 1e-10
            for alg in ("mpi", "naive", "ring"):
                x = cupy.asarray(ins[r])
                g.all_reduce(x, algorithm=alg)
                out = cupy.empty(b - a, dt)
                g.reduce_scatter(out, cupy.asarray(ins[r]), algorithm=alg)
                full = cupy.zeros(size, dt)
                g.all_gather(full, cupy.asarray(ref[a:b].astype(dt)), algorithm=alg)
                cupy.cuda.get_current_stream().synchronize()
                checks = [("all_reduce", to_numpy(x), ref), ("reduce_scatter", to_numpy(out), ref[a:b]),
                          ("all_gather", to_numpy(full), ref.astype(dt))]
                for name, got, want in checks:
                    if not np.allclose(got, want, rtol=tol, atol=tol * 100):
                        fails.append(f"{name} {alg} {np.dtype(dt)} size={size}")
    x = cupy.full(1000, float(r + 1))
    w = g.all_reduce(x, op="avg", async_op=True)
    w.wait()
    if not np.allclose(to_numpy(x), (n + 1) / 2):
        fails.append("async avg all_reduce")
    ok = all(g.all_gather_object(not fails))
    if r == 0:
        print(("PASS" if ok else "FAIL") + f": gpu_check on {n} rank(s), NCCL via cupy {cupy.__version__}")
        from machine import report
        report("gpu_check", {"ranks": n, "ok": ok, "cupy": cupy.__version__})
    for f in fails:
        print(f"  rank {r} FAILED {f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
