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


def test_dp_split_for_hybrid_sharding():
    """DeviceMesh's dp = dp_replicate x dp_shard (HSDP), in process: dp alone is (dp, 1, dp); a missing
    split size follows from dp; sizes that disagree are refused with one message naming them."""
    from pdist.comm.mesh import split_dp
    assert split_dp(None, None, None) == (1, 1, 1)
    assert split_dp(4, None, None) == (4, 1, 4)                  # DeviceMesh(dp=4): ZeRO over all 4
    assert split_dp(None, 2, 2) == (4, 2, 2)
    assert split_dp(4, None, 2) == split_dp(4, 2, None) == split_dp(4, 2, 2) == (4, 2, 2)
    assert split_dp(None, 2, None) == (2, 2, 1) and split_dp(None, None, 3) == (3, 1, 3)
    for bad in ((4, 2, 3), (4, 3, None), (6, None, 4)):
        with pytest.raises(ValueError, match="dp must equal dp_replicate \\* dp_shard"):
            split_dp(*bad)
    for bad in ((None, 0, 2), (None, 2, 1.5), (0, None, None)):
        with pytest.raises(ValueError, match="must be a positive integer"):
            split_dp(*bad)
