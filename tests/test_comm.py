"""Collectives on real MPI: every op x algorithm at n = 1, 2, 3, 4 (3 catches
power-of-two assumptions), bad inputs, cooperative waits, the harness itself."""
import os
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest

from pdist.testing import MPIRunError, mpirun, reports
from shared_launch import chosen, own, world

W = Path(__file__).parent / "workers"


def cores():
    return len(os.sched_getaffinity(0))


def test_chunk_bounds_equal_array_split():
    from pdist.comm import chunk_bounds
    for size in (0, 1, 2, 5, 7, 100, 1001):
        for n in (1, 2, 3, 4, 7):
            parts = np.array_split(np.arange(size), n)
            assert [(p[0], p[-1] + 1) if p.size else None for p in parts] == \
                [(a, b) if b > a else None for a, b in chunk_bounds(size, n)]
            assert [b - a for a, b in chunk_bounds(size, n)] == [p.size for p in parts]


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py):
    the collectives, then the bad inputs (which leave the group usable, by design)."""
    return chosen({f"test_collectives[{n}]": [W / "comm_collectives.py", "1" if n > cores() else "0"],
                   f"test_bad_inputs_raise_on_every_rank[{n}]": [W / "comm_errors.py"]}, names)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives(n, request):
    """All ops x algorithms, sizes 0..20003, f32/f64/int64, async, p2p, stats;
    at n=4 also the dp and tp groups of a 2x2 mesh. The worker asserts the wait
    mode matches oversubscription detection (ranks > cores)."""
    expect = "1" if n > cores() else "0"
    res = own(request, world(n, request))
    assert sorted(r["rank"] for r in res) == list(range(n))
    assert all(r["ok"] and r["n"] == n and r["cooperative"] == (expect == "1") for r in res)


@pytest.mark.parametrize("n,coop", [(2, "1"), (2, "0")])
def test_collectives_forced_wait_mode(n, coop):
    """Both wait paths (cooperative Test+sleep, and MPI's blocking calls) give the same results.
    At 2 ranks: spinning ranks never outnumber 2 cores (3 ranks' non-power-of-two cases:
    test_collectives[3]; the wait mode does not change which messages an algorithm sends)."""
    res = reports(mpirun(n, W / "comm_collectives.py", coop, timeout=180, env={"PDIST_COOPERATIVE_WAIT": coop}))
    assert len(res) == n and all(r["ok"] and r["cooperative"] == (coop == "1") for r in res)


def test_forced_blocking_waits_win_over_oversubscription():
    """PDIST_COOPERATIVE_WAIT=0 turns cooperative waits off where 2 ranks share one core (each
    pins itself before start-up; it then stops: nothing spins there but start-up's exchange)."""
    res = reports(mpirun(2, W / "comm_collectives.py", "0", "one-core", timeout=60,
                         env={"PDIST_COOPERATIVE_WAIT": "0"}))
    assert len(res) == 2 and all(r["ok"] and not r["cooperative"] for r in res)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_bad_inputs_raise_on_every_rank(n, request):
    res = own(request, world(n, request))
    assert sorted(r["rank"] for r in res) == list(range(n)) and all(r["ok"] for r in res)


def test_harness_names_failing_rank():
    with pytest.raises(MPIRunError) as e:
        mpirun(3, W / "comm_fail.py", timeout=60)
    msg = str(e.value)
    assert "failing rank(s): [1]" in msg and "deliberate failure on rank one" in msg


def test_harness_kills_a_hang():
    token = f"launch-{uuid.uuid4().hex}"        # names only this launch's processes
    with pytest.raises(MPIRunError, match="timed out"):
        mpirun(2, W / "comm_fail.py", "hang", token, timeout=4)
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout
    assert left.strip() == "", f"stray ranks left: {left}"


def test_single_process_init_and_threads():
    """Plain `python` (no mpiexec): world of 1, BLAS threads limited to cores."""
    from threadpoolctl import threadpool_info
    from pdist import comm
    w = comm.init()
    assert w.size == 1 and w.rank == 0 and comm.init() is w
    x = np.arange(5.0)
    w.all_reduce(x, algorithm="ring")
    assert np.array_equal(x, np.arange(5.0))
    for pool in threadpool_info():
        if pool["user_api"] == "blas":
            assert pool["num_threads"] <= cores()
