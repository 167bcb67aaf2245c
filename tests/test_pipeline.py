"""Pipeline parallelism under real mpiexec: equivalence with single-process
training for every schedule (tests/workers/pp_equiv.py), a job of the suite's launch at each
world size (tests/shared_launch.py)."""
import pytest

from shared_launch import own, world


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {f"test_pipeline_equals_single_process[{n}]": (n, ["tests/workers/pp_equiv.py"]) for n in (1, 2, 4)}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pipeline_equals_single_process(n, request):
    out = world(n, request)
    (got,) = own(request, out)
    assert got["n"] == n and len(got["cases"]) == {1: 8, 2: 11, 4: 18}[n], out
