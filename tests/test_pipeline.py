"""Pipeline parallelism under real mpiexec: equivalence with single-process
training for every schedule (tests/workers/pp_equiv.py), and lesson 05's JSON."""
import pytest

from pdist.testing import mpirun


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pipeline_equals_single_process(n):
    out = mpirun(n, "tests/workers/pp_equiv.py", timeout=300)
    assert f"pp_equiv OK on {n} ranks" in out, out
