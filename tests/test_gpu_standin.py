"""The GPU code path on CPU: PDIST_DEVICE=gpu with the strict CuPy stand-in
(tests/strict_cupy: device arrays that refuse implicit host transfers, NCCL emulated
over MPI with blocking large sends). Runs the pipeline, comm and lesson-00 test files
in a subprocess with that environment, and the device-transport worker (collectives,
1F1B and interleaved pipelines with 8 MiB activations) over the NCCL path and over
MPI host staging."""
import os
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


# test_lessons_00's broken-gradient test replaces PYTHONPATH (it would lose the stand-in)
FILES = [("tests/test_pipeline.py", None), ("tests/test_comm.py", "not harness_kills_a_hang"),
         ("tests/test_lessons_00.py", "not gradient_is_wrong")]


@pytest.mark.parametrize("path,select", FILES, ids=[f for f, _ in FILES])
def test_file_passes_on_the_standin(path, select):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path] + (["-k", select] if select else [])
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert " passed" in p.stdout


@pytest.mark.parametrize("n,transport", [(2, "nccl"), (4, "nccl"), (2, "mpi-host")])
def test_device_transport(n, transport):
    env = _env(transport)
    out = mpirun(n, STANDIN / "workers" / "device_comm.py", transport, env=env, timeout=240)
    assert all(f"OK rank {r} {transport}" in out for r in range(n)), out[-3000:]


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
    from pdist.comm import nccl
    assert nccl.choose_transport(True, 22304)[0] == "mpi-host"
    assert nccl.choose_transport(False, 22304)[0] == "nccl"
    assert nccl.choose_transport(True, None)[0] == "mpi-host"
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    try:
        assert nccl.choose_transport(True, 23000)[0] == "nccl"
        assert "2.29" in nccl.choose_transport(True, 22905)[1]
    finally:
        del os.environ["NCCL_MULTI_RANK_GPU_ENABLE"]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_executor_order_cannot_deadlock_with_blocking_sends(p):
    from pdist.parallel import schedules as S
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 2)):
        for m in sorted({1, p, 2 * p}):
            sched = S.make_schedule(name, p, m, v)
            S.check_schedule(sched, m)
            S.simulate_rendezvous(sched)            # the executor's plan: must finish
    if p >= 2:                                      # the checker has teeth: lone sends in program order deadlock
        with pytest.raises(S.DeadlockError):
            S.simulate_rendezvous(S.make_schedule("1f1b", p, 2 * p), plan="program")
