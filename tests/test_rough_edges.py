"""Rough edges that must end in a clear error, never a silent wrong answer:
PDIST_DEVICE / PDIST_MALLOC_TUNE values, a CuPy without a GPU, lesson flags
checked before training, and the JSON summary written atomically as strict JSON."""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pdist import lesson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_pdist(env, pythonpath=()):
    env = {k: v for k, v in os.environ.items() if k not in ("PDIST_DEVICE", "PDIST_MALLOC_TUNE")} | env
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), ROOT])
    code = "import pdist; from pdist import backend; print(backend.device())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=60)


# --- PDIST_DEVICE ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["cpu", "CPU", "  cpu ", ""])
def test_pdist_device_cpu_spellings(value):
    p = import_pdist({"PDIST_DEVICE": value})
    assert p.returncode == 0 and p.stdout.strip() == "cpu", p.stderr


@pytest.mark.parametrize("value", ["cuda", "gpu0", "1", "cpu,gpu"])
def test_pdist_device_rejects_other_values(value):
    p = import_pdist({"PDIST_DEVICE": value})
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: PDIST_DEVICE=") and repr(value) in last
    assert "'cpu' or 'gpu'" in last


FAKE_CUPY = '''
import os
class CUDARuntimeError(RuntimeError):
    pass
class runtime:
    CUDARuntimeError = CUDARuntimeError
    @staticmethod
    def getDeviceCount():
        if os.environ.get("FAKE_CUPY_ZERO"):
            return 0
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")
class cuda:
    runtime = runtime
'''


@pytest.mark.parametrize("zero", [False, True])
def test_pdist_device_gpu_with_cupy_but_no_gpu(tmp_path, zero):
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    env = {"PDIST_DEVICE": " GPU "} | ({"FAKE_CUPY_ZERO": "1"} if zero else {})
    p = import_pdist(env, pythonpath=[tmp_path])
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: PDIST_DEVICE=gpu but CuPy finds no CUDA driver/GPU: "), p.stderr
    assert ("0 devices" in last) if zero else ("cudaErrorInsufficientDriver" in last)


# --- PDIST_MALLOC_TUNE -----------------------------------------------------------------------
def test_malloc_tune_flag(monkeypatch):
    from pdist import backend
    monkeypatch.setenv("PDIST_MALLOC_TUNE", "off")
    assert backend.tune_malloc() is False
    monkeypatch.setenv("PDIST_MALLOC_TUNE", "maybe")
    with pytest.raises(ValueError, match="PDIST_MALLOC_TUNE='maybe'"):
        backend.tune_malloc()
    p = import_pdist({"PDIST_MALLOC_TUNE": "2"})
    assert p.returncode != 0 and "PDIST_MALLOC_TUNE='2'" in p.stderr
    assert import_pdist({"PDIST_MALLOC_TUNE": "No"}).returncode == 0
