"""DeviceMesh: rank order, sub-groups with real traffic, invalid shapes (tests/workers/mesh_worker.py,
a job of the suite's launch at each world size: tests/shared_launch.py)."""
from pathlib import Path

import pytest

from shared_launch import own, world

W = Path(__file__).parent / "workers"


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {f"test_mesh_every_factorization[{n}]": (n, [W / "mesh_worker.py"]) for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mesh_every_factorization(n, request):
    out = world(n, request)
    (got,) = own(request, out)
    assert got["n"] == n and len(got["shapes"]) == {1: 1, 2: 3, 3: 3, 4: 6}[n], out
