"""Pipeline parallelism under real mpiexec: equivalence with single-process
training for every schedule (tests/workers/pp_equiv.py), a job of the suite's launch at each
world size (tests/shared_launch.py)."""
import pytest

from shared_launch import own, suite_world


def suite_jobs(n, names):
    """This module's job at n ranks in the suite's launch of that size."""
    test = f"test_pipeline_equals_single_process[{n}]"
    return {test: ["tests/workers/pp_equiv.py"]} if test in names else {}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pipeline_equals_single_process(n, request):
    out = suite_world(n, request)
    (got,) = own(request, out)
    assert got["n"] == n and len(got["cases"]) == {1: 8, 2: 11, 4: 18}[n], out
