"""Device arrays through the device transport (NCCL stand-in, or MPI host staging):
every collective x algorithm against NumPy, then 1F1B and interleaved pipelines whose
activations are 8 MiB (above the stand-in's 4 MiB rendezvous threshold: a lone send
blocks until matched) on an nn.Sequential. Prints OK on every rank."""
import sys

import numpy as np

import cupy
from pdist import comm, nn
from pdist.engine.backend import is_device_array, to_numpy
from pdist.comm.host_staging import MPIHostBackend
from pdist.comm.nccl import NCCLBackend
from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel

g = comm.init()
n, r = g.size, g.rank
want = sys.argv[1]
be = g._device_backend()
assert want == "auto" or isinstance(be, {"nccl": NCCLBackend, "mpi-host": MPIHostBackend}[want]), type(be)
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
        np.testing.assert_allclose(to_numpy(x), ref, rtol=1e-12, atol=1e-12, err_msg=f"all_reduce {alg}")
        np.testing.assert_allclose(to_numpy(out), ref[a:b], rtol=1e-12, atol=1e-12, err_msg=alg)
        np.testing.assert_allclose(to_numpy(full), ref, rtol=1e-12, atol=1e-12, err_msg=alg)
    for alg in ("mpi", "naive", "tree"):
        x = cupy.asarray(ins[r])
        g.broadcast(x, src=n - 1, algorithm=alg)
        np.testing.assert_array_equal(to_numpy(x), ins[n - 1])
avg = cupy.full(10, float(r + 1))
w = g.all_reduce(avg, op="avg", async_op=True)
w.wait()
np.testing.assert_array_equal(to_numpy(avg), np.full(10, (n + 1) / 2))
h = np.arange(5.0) * (r + 1)                 # a NumPy collective stays on the host on a GPU backend
g.all_reduce(h, algorithm="ring")
assert isinstance(h, np.ndarray) and np.allclose(h, np.arange(5.0) * n * (n + 1) / 2)

# pipelines with 8 MiB activations: rows x H float32
rows, H, m = 2048, 1024, 2 * n         # float32: 8 MiB
for schedule, v in (("1f1b", 1), ("interleaved", 2)):
    layers = [nn.Linear(H, H, bias=False) for _ in range(n * v)]
    pipe = PipelineParallel(nn.Sequential(*layers), g, schedule, m, v,
                            act_shape=lambda k, rows_, x: (rows_, H), loss_fn=nn.mse_loss)
    xb = np.random.default_rng(0).standard_normal((rows * m, H)).astype(np.float32)
    loss = pipe.forward_backward(xb, np.zeros((rows * m, H), np.float32))
    assert np.isfinite(loss), loss
    assert not pipe._recvs and not pipe._stash
if r == 0:
    from cupy.cuda import nccl
    print(f"stats {nccl._STATS}")
print(f"OK rank {r} {want}", flush=True)
