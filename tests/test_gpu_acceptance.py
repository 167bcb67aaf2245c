"""bench/gpu_acceptance.sh and what it runs, without a GPU: the script's syntax and its "no GPU"
exit (2, with a JSON summary that says so); its driver on the strict CuPy stand-in (steps a and
e, small sizes: the JSON rewritten per step, a step's timeout recorded); and its device worker's
steps a-d in one launch per transport (tests/strict_cupy: PDIST_DEVICE=gpu). Also the device
memory truth (a MemoryHook's live bytes and high-water mark) and attention's explicit GEMMs."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdist.testing import launch

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "strict_cupy"


def _env(**extra):
    env = dict(os.environ, PDIST_DEVICE="gpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(STANDIN)]))
    env.update(extra)
    return env


def test_script_says_no_gpu_and_its_json_says_so(tmp_path):
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_acceptance.sh")]).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("PDIST_DEVICE", "PYTHONPATH", "OUT")}
    env["WHEELS"] = str(tmp_path / "no-wheels")                       # nothing to install
    p = subprocess.run(["bash", "bench/gpu_acceptance.sh", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "FAIL no GPU" in p.stdout, p.stdout
    summary = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    assert summary["status"] == "no GPU" and summary["facts"]["gpu"] is False and summary["steps"] == []


def test_driver_on_the_standin_writes_every_step(tmp_path):
    """Steps a (CuPy == NumPy, one process) and e (MFU per precision) pass on the stand-in;
    the summary has the facts, each step's cases or MFU rows; a step cut at its timeout is a
    TIMEOUT in the JSON and the run exits 1."""
    drv = [sys.executable, str(ROOT / "bench" / "gpu_acceptance.py"), "--standin"]
    path, seen = tmp_path / "gpu_acceptance.json", set()
    with subprocess.Popen(drv + ["--only", "a,e", "--out", str(tmp_path)], env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as p:
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < 240:     # the summary while it runs
            if path.exists():
                s = json.loads(path.read_text())
                seen.add((s["status"], len(s["steps"])))
            time.sleep(0.05)
        out = p.communicate(timeout=10)[0]
    assert p.returncode == 0, out[-4000:]
    assert ("running", 1) in seen, seen                   # step a's entry was written before e ended
    s = json.loads(path.read_text())
    assert s["status"] == "PASS" and s["facts"]["gpu"] and s["facts"]["nccl"], s
    assert s["facts"]["transport_shared_gpu"][0] == "mpi-host"        # NCCL 2.23 refuses shared GPUs
    a, e = s["steps"]
    assert a["status"] == "PASS" and len(a["cases"]) == 2 and all(c["ok"] for c in a["cases"]), a
    assert e["status"] == "PASS" and [r["precision"] for r in e["rows"]] == ["fp32", "tf32", "bf16"], e
    assert all(r["peak_device_bytes"] > 0 and r["mfu_measured"] > 0 for r in e["rows"]), e
    assert "6N + 12 L T d" in e["flop_convention"]
    p = subprocess.run(drv + ["--only", "a", "--timeout", "a=0.1", "--out", str(tmp_path)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    s = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    assert p.returncode == 1 and s["status"] == "FAIL" and s["steps"][0]["status"] == "TIMEOUT", (p.stdout, s)


@pytest.mark.cores(2)
@pytest.mark.parametrize("transport,steps", [("nccl", "b,c,d"), ("mpi-host", "b,c,d")])
def test_worker_steps_on_the_standin(transport, steps):
    """bench/gpu_worker.py at 2 ranks (step a runs in the driver's test): every case of steps
    b-d passes (collectives in 4 dtypes; DDP with >= 8 buckets, ZeRO-3, 1F1B, pipelines whose
    activations exceed the stand-in NCCL's rendezvous size (lowered to 64 KiB): float64
    equality with one process; bf16 and fp16 mixed precision)."""
    run = launch(2, ROOT / "bench" / "gpu_worker.py", "--steps", steps, "--pipe-rows", 16, timeout=240, wrap=False,
                 env=_env(PDIST_GPU_TRANSPORT=transport, STRICT_CUPY_LAZY="1",       # lazy streams on
                          STRICT_CUPY_RENDEZVOUS_BYTES=1 << 16))
    cases = [ln for ln in run.out.splitlines() if ln.startswith("CASE ")]
    failed = [c for c in cases if " FAIL " in c]
    assert run.rc == 0 and not failed and len(cases) == 15, \
        "\n".join(failed) or run.out[-4000:]


DEVICE_CODE = r"""
import numpy as np, cupy
from cupy.cuda import cublas
from pdist.engine import attention_device as D
from pdist.engine.autograd import Tensor
from pdist.engine.attention import causal_self_attention
from pdist.measure import memory
rng = np.random.default_rng(0)
# gemm: op flags, leading dimensions of slices, beta, against NumPy
A, B = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 4, 6))
for ta in (False, True):
    for tb in (False, True):
        out = cupy.asarray(np.ones((3, 5, 6)))
        D.gemm(cupy.asarray(A.transpose(0, 2, 1).copy() if ta else A),
               cupy.asarray(B.transpose(0, 2, 1).copy() if tb else B), out, ta=ta, tb=tb, beta=2.0)
        assert np.allclose(out.get(), A @ B + 2), (ta, tb)
big = rng.standard_normal((2, 10, 8))
o = cupy.asarray(np.zeros((2, 10, 8)))
D.gemm(cupy.asarray(big)[:, 3:7, :4], cupy.asarray(big)[:, :4, 2:5], o[:, 1:5, :3])
assert np.allclose(o.get()[:, 1:5, :3], big[:, 3:7, :4] @ big[:, :4, 2:5]) and np.count_nonzero(o.get()) == 24
# attention in query blocks: float32 GEMMs with TF32 allowed use its compute type, and not otherwise
qkv = Tensor(cupy.asarray(rng.standard_normal((2, 16, 24)).astype(np.float32)), requires_grad=True)
D.DEVICE_QBLOCK = 4
for tf32, want in ((False, cublas.CUBLAS_COMPUTE_32F), (True, cublas.CUBLAS_COMPUTE_32F_FAST_TF32)):
    D.allow_tf32(tf32)
    del cublas.compute_types[:]
    causal_self_attention(qkv, 2).sum().backward()
    assert set(cublas.compute_types) == {want} and len(cublas.compute_types) == 4 * 2 + 4 * 4, cublas.compute_types
# the MemoryHook: live bytes and high-water mark, the pool and mem_info beside them
keep = cupy.zeros(1000)
with memory.PeakMemory() as pk:
    b = cupy.zeros(10000)
    c = cupy.zeros(5000)
    del b, c
    d = cupy.zeros(100)
dv = pk.device
assert pk.peak_bytes == dv["peak_bytes"] >= 8000 + 120000 and dv["block_peak_bytes"] >= 120000, dv
assert dv["live_bytes"] < dv["peak_bytes"] - 100000 and dv["mallocs"] == 3, dv
assert dv["pool_held_bytes"] >= dv["peak_bytes"] - 1024 and dv["outside_pool_bytes"] is not None, dv
# the memory timeline of one step on the device: the hook's live bytes at every sample
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.measure import memory_timeline
from pdist.models.gpt import GPT
set_default_dtype("float64")
model = GPT(lesson.gpt_config(50, dtype="float64", block_size=8, n_layer=1, n_head=2, n_embd=16), 0)
x = cupy.asarray(rng.integers(0, 50, (2, 8)))
with memory_timeline.record(model) as tl:
    _, loss = model(x, x)
    memory_timeline.mark("compute")
    loss.backward()
acts = [s[6] for s in tl.samples]
assert len(tl.device) == len(tl.samples) == 3 and max(acts) > 0, (acts, tl.device)
assert tl.device[1]["live_bytes"] > tl.device[0]["live_bytes"] and tl.device_row["peak_bytes"] >= max(
    d["live_bytes"] for d in tl.device), (tl.device, tl.device_row)
print("device ok")
"""


def test_device_gemm_tf32_and_memory_hook():
    """gemm's op flags and leading dimensions; attention's 4 + 4 products per block go through
    it with CUBLAS_COMPUTE_32F, or 32F_FAST_TF32 once TF32 is allowed; PeakMemory on a GPU
    is the MemoryHook's high-water mark, with the pool's and the driver's counts."""
    p = subprocess.run([sys.executable, "-c", DEVICE_CODE], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.strip() == "device ok", p.stdout + p.stderr[-3000:]
