"""Expert parallelism's collective: all_to_all_v (variable rows along axis 0) at 2 and 4
ranks, one launch each with many cases (tests/workers/moe_all_to_all_v.py)."""
from pathlib import Path

import pytest

from pdist.testing import mpirun, reports

W = Path(__file__).parent / "workers"


@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all_v(n):
    """Uneven counts incl. zeros, 4 dtypes x 3 shapes, mpi/pairwise/async, bytes exact,
    bad counts raise on every rank naming the pair; at 4 ranks the dp groups of a mesh too."""
    res = reports(mpirun(n, W / "moe_all_to_all_v.py", timeout=60))
    assert sorted(r["rank"] for r in res) == list(range(n))
    assert all(r["ok"] and r["cases"] >= 96 for r in res)
