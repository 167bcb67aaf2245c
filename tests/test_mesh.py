"""DeviceMesh: rank order, sub-groups with real traffic, invalid shapes."""
from pathlib import Path

import pytest

from pdist.testing import mpirun, reports

W = Path(__file__).parent / "workers"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mesh_every_factorization(n):
    out = mpirun(n, W / "mesh_worker.py", timeout=120)
    (got,) = reports(out)
    assert got["n"] == n and len(got["shapes"]) == {1: 1, 2: 3, 3: 3, 4: 6}[n], out
