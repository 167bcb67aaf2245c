"""NCCL transport: imports safely without CuPy; the one-rank check runs where a GPU is."""
from pathlib import Path

import pytest

from pdist.testing import mpirun

ROOT = Path(__file__).resolve().parent.parent


def test_nccl_module_imports_without_cupy():
    from pdist.comm import gpu_transport, nccl
    assert isinstance(gpu_transport.available(), bool) and hasattr(nccl, "NCCLBackend")


def test_gpu_check_skips_cleanly_without_gpu():
    from pdist.comm import gpu_transport
    if gpu_transport.available():
        pytest.skip("a GPU is present: the real check runs below")
    out = mpirun(1, ROOT / "bench" / "gpu_check.py", timeout=60)
    assert "SKIP" in out


@pytest.mark.gpu
def test_nccl_one_rank_matches_numpy():
    from pdist.comm import gpu_transport
    if not gpu_transport.available():
        pytest.skip("needs CuPy with NCCL and a CUDA GPU")
    out = mpirun(1, ROOT / "bench" / "gpu_check.py", timeout=300)
    assert "PASS" in out
