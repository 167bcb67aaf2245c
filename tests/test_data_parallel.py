"""Data parallelism (issue 4): equivalence with single-process training under real
mpiexec (n = 2, 4), overlap order, accounting, errors, and lesson 02's JSON."""
from pathlib import Path

import numpy as np
import pytest

from pdist import nn
from pdist.parallel.data_parallel import build_buckets
from shared_launch import own, world

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "dp_equiv.py"


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {f"test_equivalence_overlap_errors[{n}]": (n, [WORKER]) for n in (2, 4)}


@pytest.mark.parametrize("n", [2, 4])
def test_equivalence_overlap_errors(n, request):
    out = world(n, request)
    got = {r["case"]: r for r in own(request, out)}
    assert set(got) == {"naive accum=1", "naive accum=2", "bucketed accum=1", "bucketed accum=2", "overlap",
                        "errors and replica sync"}, out
    assert got["overlap"]["issued_during_backward"] >= 1


def test_build_buckets_reverse_order_caps_and_dtypes():
    ps = [nn.Parameter(np.zeros(k, dtype=np.float64)) for k in (10, 10, 10, 40, 10)]  # 80, 80, 80, 320, 80 B
    ps.append(nn.Parameter(np.zeros(10, dtype=np.float32)))                           # 40 B, other dtype
    groups = build_buckets(ps, bucket_cap_bytes=200, first_bucket_cap_bytes=50)
    ids = [[ps.index(p) for p in g] for g in groups]
    # reverse order; first bucket small; a dtype change and an oversize parameter start new buckets
    assert ids == [[5], [4], [3], [2, 1], [0]]
    for g in groups:
        assert len({p.dtype for p in g}) == 1
