"""The GPU code path on CPU: PDIST_DEVICE=gpu with the strict CuPy stand-in
(tests/strict_cupy: device arrays that refuse implicit host transfers, NCCL emulated
over MPI with blocking large sends; lazy streams in the device workers). Runs the device
cases of the pipeline, comm, lesson-00 and tensor-parallel test files in a subprocess with
that environment, and tests/workers/gpu_standin_cases.py (issue 24's defects, every
collective x algorithm, pipelines whose sends block) over the NCCL path and over MPI host
staging."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdist.testing import mpirun

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "strict_cupy"


def _env(transport="nccl"):
    env = dict(os.environ, PDIST_DEVICE="gpu", PDIST_GPU_TRANSPORT=transport,
               PYTHONPATH=os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


# Of each host file, the cases that take the device code paths, once (the host run keeps every
# size and rank count): comm at 3 ranks (every op x algorithm, f32/f64/int64, async, p2p: odd n)
# and its errors at 2; every schedule at pp = 2; every TP layer and TensorParallel(GPT) at 2;
# lesson 00's GPT run (Llama on the device: test_gpu_acceptance's step a).
FILES = {"comm": ["tests/test_comm.py::test_collectives[3]", "tests/test_comm.py::test_bad_inputs_raise_on_every_rank[2]"],
         "pipeline": ["tests/test_pipeline.py::test_pipeline_equals_single_process[2]"],
         "lessons_00": ["tests/test_lessons_00.py::test_lesson_00_json_summary"],
         "tensor_parallel": ["tests/test_tensor_parallel.py::test_layers[2]",
                             "tests/test_tensor_parallel.py::test_gpt_equivalence_and_comm_counts[2]"]}


@pytest.mark.cores(3)          # host test cases in a subprocess: their jobs of up to 3 ranks
@pytest.mark.parametrize("ids", FILES.values(), ids=FILES.keys())
def test_file_passes_on_the_standin(ids):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert re.search(rf"^{len(ids)} passed", p.stdout, re.M), p.stdout[-3000:]      # none skipped


# Every collective x algorithm on device arrays and the pipelines with activations above the
# rendezvous size: the "comm" case of test_device_defects_fixed_with_lazy_streams (4 ranks: the
# world and pairs, both transports) and test_gpu_acceptance's steps b, c (2 ranks, both).


def test_standin_is_strict():
    code = ("import numpy as np, cupy\n"
            "a = cupy.asarray(np.ones(3))\n"
            "for f in (lambda: np.asarray(a), lambda: float(a[0]), lambda: a.tolist(), lambda: np.exp(a),\n"
            "          lambda: bool(a[0] > 0), lambda: a + np.ones(3), lambda: np.sum(a)):\n"
            "    try:\n        f()\n    except TypeError:\n        continue\n    raise SystemExit('not refused')\n"
            "assert not isinstance(a.data, np.ndarray) and cupy.asnumpy(a).sum() == 3\nprint('strict')\n")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "strict", p.stderr


def test_transport_choice():
    from pdist.comm import gpu_transport
    assert gpu_transport.choose_transport(True, 22304)[0] == "mpi-host"
    assert gpu_transport.choose_transport(False, 22304)[0] == "nccl"
    assert gpu_transport.choose_transport(True, None)[0] == "mpi-host"
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    try:
        assert gpu_transport.choose_transport(True, 23000)[0] == "nccl"
        assert "2.29" in gpu_transport.choose_transport(True, 22905)[1]
    finally:
        del os.environ["NCCL_MULTI_RANK_GPU_ENABLE"]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_executor_order_cannot_deadlock_with_blocking_sends(p):
    from pdist.parallel.pipeline import schedules as S
    from pdist.parallel.pipeline import simulate as sim
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 2)):
        for m in sorted({1, p, 2 * p}):
            sched = S.make_schedule(name, p, m, v)
            sim.check_schedule(sched, m)
            sim.simulate_rendezvous(sched)            # the executor's plan: must finish
    if p >= 2:                                      # the checker has teeth: lone sends in program order deadlock
        with pytest.raises(S.DeadlockError):
            sim.simulate_rendezvous(S.make_schedule("1f1b", p, 2 * p), plan="program")


def test_clip_grad_norm_on_device_arrays():
    """clip_grad_norm_ on device gradients: no implicit host transfer (the stand-in would
    refuse one), the same norm and scaled gradients as NumPy, the non-finite report too."""
    code = ("import math, numpy as np, cupy\n"
            "from pdist.engine.autograd import Tensor\n"
            "from pdist.engine.backend import to_numpy\n"
            "from pdist.errors import NonFiniteError\n"
            "from pdist.optim import clip_grad_norm_\n"
            "g = [np.arange(6.0).reshape(2, 3), np.array([-3.0, 4.0])]\n"
            "def params(gs):\n"
            "    ps = [Tensor(np.zeros(a.shape), requires_grad=True, name=f'p{i}') for i, a in enumerate(gs)]\n"
            "    for p, a in zip(ps, gs):\n        p.grad = cupy.asarray(a)\n    return ps\n"
            "want = math.sqrt(sum(float((a ** 2).sum()) for a in g))\n"
            "ps = params(g)\n"
            "assert isinstance(ps[0].grad, cupy.ndarray)\n"
            "n = clip_grad_norm_(ps, 1.0)\n"
            "assert isinstance(n, float) and abs(n - want) < 1e-12, n\n"
            "np.testing.assert_allclose(to_numpy(ps[1].grad), g[1] / (want + 1e-6), rtol=1e-12)\n"
            "assert clip_grad_norm_(params(g), 1.0, norm_type=math.inf) == 5.0\n"
            "assert abs(clip_grad_norm_(params(g), 100.0, norm_fn=lambda s: cupy.asarray(s) * 4) - 2 * want) < 1e-9\n"
            "bad = params([g[0], np.array([np.inf, 1.0])])\n"
            "try:\n    clip_grad_norm_(bad, 1.0, error_if_nonfinite=True)\n"
            "except NonFiniteError as e:\n    assert 'p1' in str(e) and 'p0' not in str(e).split('gradients:')[1], e\n"
            "else:\n    raise SystemExit('no NonFiniteError')\n"
            "print('clipped')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "clipped", p.stdout + p.stderr[-3000:]


# DDP, ZeRO-3 and 1F1B at 2 ranks on device arrays equal one process: test_gpu_acceptance's
# step c, on both transports.


def test_gpu_mfu_says_no_gpu_without_one():
    env = {k: v for k, v in os.environ.items() if k not in ("PDIST_DEVICE", "PYTHONPATH")}
    p = subprocess.run([sys.executable, "bench/gpu_mfu.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "no GPU" in p.stdout, (p.returncode, p.stdout, p.stderr)


def test_one_step_reads_the_device_twice_and_traces_device_time():
    """A step of 4 micro-batches on device arrays: the token-id checks of every embedding and
    loss are read back together (one copy) and the losses together (one copy), not per
    micro-batch (was 12 copies); a bad id still raises pdist's IndexError (CuPy itself wraps
    it around silently, and so does the stand-in). With trace detail, the forward and backward
    of each micro-batch are on the trace's "device" track (CUDA events)."""
    code = ("import numpy as np, cupy\n"
            "from pdist.measure import trace\n"
            "from pdist.engine.backend import set_default_dtype\n"
            "from pdist.models.gpt import GPT, GPTConfig\n"
            "from pdist.parallel.base import Local\n"
            "set_default_dtype('float64')\n"
            "cfg = GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype='float64')\n"
            "m = Local(GPT(cfg, seed=0), microbatches=4)\n"
            "rng = np.random.default_rng(0)\n"
            "x, y = (cupy.asarray(rng.integers(0, 50, (8, 8))) for _ in range(2))\n"
            "m.forward_backward(x, y)\n"
            "trace.set_detail(True)\n"
            "r0 = cupy.host_reads[0]\n"
            "m.forward_backward(x, y)\n"
            "reads = cupy.host_reads[0] - r0\n"
            "dev = [e for e in trace.events() if e['cat'] == 'device']\n"
            "assert sorted({e['name'] for e in dev}) == ['backward', 'forward'] and len(dev) == 8, dev\n"
            "assert all(e['end'] >= e['start'] for e in dev)\n"
            "m.check_finite = False\n"
            "r0 = cupy.host_reads[0]\n"
            "m.forward_backward(x, y)\n"
            "unchecked = cupy.host_reads[0] - r0\n"
            "m.check_finite = True\n"
            "from pdist.comm.flight_recorder import batch_hash\n"
            "r0 = cupy.host_reads[0]\n"
            "h = batch_hash(x, y)\n"
            "assert cupy.host_reads[0] - r0 == 1, 'batch_hash copied the batch'\n"
            "x2 = x.copy(); x2[3, 4] += 1\n"
            "assert h == batch_hash(x.copy(), y) and h != batch_hash(x2, y) and h != batch_hash(y, x)\n"
            "bad = cupy.asarray(np.where(np.arange(64).reshape(8, 8) == 5, 50, 1))\n"
            "try:\n    m.forward_backward(bad, y)\n"
            "except IndexError as e:\n    assert 'embedding index out of range: values span [1, 50]' in str(e), e\n"
            "else:\n    raise SystemExit('no IndexError for token id 50 of 50')\n"
            "print('reads', reads, unchecked)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    # 2 reads: the id checks and the losses; check_finite (on by default) adds its one flag
    assert p.stdout.strip() == "reads 3 2", p.stdout + p.stderr[-3000:]


def _lazy_env(transport, **extra):
    return {**_env(transport), "STRICT_CUPY_LAZY": "1", "PDIST_TIMEOUT": "60", **extra}


@pytest.mark.cores(4)
@pytest.mark.parametrize("transport", ["nccl", "mpi-host"])
def test_device_defects_fixed_with_lazy_streams(transport):
    """Issue 24's three wrong results, with lazy streams (tests/workers/gpu_standin_cases.py,
    4 ranks: the world and pairs): DDP with >= 8 buckets equals one process, fp16/bf16
    op="avg" gives the CPU path's bits, bf16 collectives move the bits, the user's send
    matches an irecv; every collective x algorithm and 1F1B/interleaved pipelines whose lone
    sends block (activations above the 64 KiB rendezvous size set here); over NCCL the communicators are destroyed newest first at exit."""
    env = _lazy_env(transport, STRICT_CUPY_LOG_DESTROY="1", STRICT_CUPY_RENDEZVOUS_BYTES="65536")
    out = mpirun(4, ROOT / "tests" / "workers" / "gpu_standin_cases.py", env=env, timeout=240)
    assert all(f"OK rank {r} {transport}" in out for r in range(4)), out[-3000:]
    for case in ("ddp", "avg", "bf16", "comm", "p2p", "identity", "lazy"):
        assert f'"case": "{case}"' in out, (case, out[-3000:])
    if transport == "nccl":
        for r in range(4):      # a unique id is (its root, the root's count): newest first per root
            # the ranks share one stream: a line may be glued to another rank's, so match messages, not lines
            lines = re.findall(rf"strict_cupy: rank {r} destroys the communicator of world ranks \[(\d+)[^\]]*\] \(#(\d+)\)",
                               out)
            order = [int(c) for root, c in lines if root == "0"]
            assert len(order) >= 2 and order == sorted(order, reverse=True), (r, lines)


def test_stuck_nccl_kernel_aborts_instead_of_hanging():
    """The first NCCL call never completes: the read of its result times out under
    PDIST_TIMEOUT, the communicators are aborted, every rank raises (tests/workers/gpu_stall.py)."""
    env = _lazy_env("nccl", PDIST_TIMEOUT="1", STRICT_CUPY_NCCL_STALL="1")
    out = mpirun(2, ROOT / "tests" / "workers" / "gpu_stall.py", env=env, timeout=60)
    assert all(f"OK rank {r} aborted" in out for r in range(2)), out[-3000:]


STANDIN_CHECKS = """
import ml_dtypes, numpy as np, cupy
from cupy.cuda import _lazy, nccl
real = {'NcclCommunicator', 'NcclConfig', 'NcclError', 'available', 'check_status', 'get_build_version',
        'get_unique_id', 'get_version', 'groupEnd', 'groupStart'}
public = {n for n in dir(nccl) if not n.startswith('_') and not n.startswith('NCCL_')}
assert public <= real | {'annotations'}, public - real
assert (nccl.NCCL_BFLOAT16, nccl.NCCL_AVG, nccl.NCCL_FLOAT16, nccl.NCCL_UINT64) == (9, 4, 6, 5)
uid = nccl.get_unique_id()
assert isinstance(uid, bytes) and len(uid) == 128
cupy.asarray(np.ones(2, ml_dtypes.bfloat16))
for bad in (lambda: cupy.asarray(np.ones(2, ml_dtypes.float8_e4m3fn)), lambda: cupy.geomspace,
            lambda: cupy.asarray(np.ones(2)).resize):
    try:
        bad()
    except (ValueError, AttributeError):
        continue
    raise SystemExit('not refused')
# lazy: an op on a non-default stream runs when the compute stream waits on its event
comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
s = cupy.cuda.Stream(non_blocking=True)
src, dst = cupy.full(3, 2.0), cupy.zeros(3)
comm.allReduce(src.data.ptr, dst.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s.ptr)
ev = cupy.cuda.Event()
ev.record(s)
assert not ev.done and dst.get().sum() == 0        # queued: not run, and a query does not run it
cupy.cuda.get_current_stream().wait_event(ev)
assert ev.done and dst.get().sum() == 6
# a buffer dropped while queued is poisoned
src = cupy.full(3, 2.0)
comm.allReduce(src.data.ptr, dst.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s.ptr)
view = src[1:]
del src
assert _lazy.STATS['poisoned'] == 0                # a view still holds the memory
del view
assert _lazy.STATS['poisoned'] == 1
s.synchronize()
assert np.isnan(dst.get()).all()
print('standin ok')
"""


def test_standin_models_cupy14_and_lazy_streams():
    """The stand-in's NCCL names, constants and bytes unique id are CuPy 14.2's, its dtype
    table refuses what CuPy's refuses, and its lazy streams defer and poison."""
    p = subprocess.run([sys.executable, "-c", STANDIN_CHECKS], env=dict(_env(), STRICT_CUPY_LAZY="1"),
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "standin ok", p.stdout + p.stderr[-3000:]
