"""DeviceMesh: rank order, sub-groups with real traffic, invalid shapes (tests/workers/mesh_worker.py,
a job of the suite's launch at each world size: tests/shared_launch.py)."""
from pathlib import Path

import pytest

from shared_launch import own, suite_world

W = Path(__file__).parent / "workers"


def suite_jobs(n, names):
    """This module's job at n ranks in the suite's launch of that size."""
    test = f"test_mesh_every_factorization[{n}]"
    return {test: [W / "mesh_worker.py"]} if test in names else {}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mesh_every_factorization(n, request):
    out = suite_world(n, request)
    (got,) = own(request, out)
    assert got["n"] == n and len(got["shapes"]) == {1: 1, 2: 3, 3: 3, 4: 6}[n], out
