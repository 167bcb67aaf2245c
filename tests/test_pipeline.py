"""Pipeline parallelism under real mpiexec: equivalence with single-process
training for every schedule (tests/workers/pp_equiv.py)."""
import pytest

from pdist.testing import mpirun, reports


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pipeline_equals_single_process(n):
    out = mpirun(n, "tests/workers/pp_equiv.py", timeout=300)
    (got,) = reports(out)
    assert got["n"] == n and len(got["cases"]) == {1: 8, 2: 11, 4: 18}[n], out
