"""Never a silent hang, never a silent wrong answer (docs/failures.md).

Each scenario of tests/workers/fail_cases.py runs under a real ``mpiexec`` at
2 and 4 ranks, as users run it (``mpiexec python script``, no wrapper) unless
noted, with ``PDIST_TIMEOUT=4``. A failing job must exit non-zero well before
the harness's own kill, with the right error from every rank that waits."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdist.testing import failures, launch, reports

W = Path(__file__).parent / "workers"
TIMEOUT = 4                      # PDIST_TIMEOUT in these runs
LIMIT = TIMEOUT + 8              # must end by then: the timeout, the roll-call, the abort, start-up on a loaded box


def run(n, case, tmp_path, wrap=False, env=None):
    e = {"PDIST_TIMEOUT": str(TIMEOUT), "PDIST_FLIGHT_DIR": str(tmp_path), **(env or {})}
    res = launch(n, W / "fail_cases.py", case, timeout=60, env=e, wrap=wrap)
    assert not res.timed_out, f"{case}: the harness had to kill the job\n{res.out[-3000:]}"
    return res


def ended(res, case):
    assert res.rc != 0, f"{case}: exited 0\n{res.out[-3000:]}"
    assert res.seconds < LIMIT, f"{case}: took {res.seconds:.1f}s"
    return failures(res.out)


def others(n, but=1):
    return [r for r in range(n) if r != but]


def names(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def wait(ranks):
    return names(ranks) + (" waits" if len(ranks) == 1 else " wait")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("wrap", [False, True], ids=["mpiexec", "harness"])
def test_exception_on_one_rank(n, wrap, tmp_path):
    f = ended(run(n, "exception", tmp_path, wrap=wrap), "exception")
    assert "RuntimeError: deliberate failure on rank 1" in f[1] and "Traceback" in f[1]
    for r in others(n):
        assert "CollectiveTimeoutError: rank 1 failed (RuntimeError: deliberate failure on rank 1)" in f[r], f[r]
        assert f"{wait(others(n))} in all_reduce #4 on group 'world'" in f[r]
    dump = json.loads((tmp_path / "pdist_flight_rank1.json").read_text())
    assert [e["seq"] for e in dump["entries"]] == [1, 2, 3] and dump["rank"] == 1


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["exit0", "early_exit"])
def test_rank_exits_early(n, case, tmp_path):
    """sys.exit(0), or the script just ending, on rank 1 while others still collect."""
    f = ended(run(n, case, tmp_path), case)
    for r in others(n):
        head = f[r].splitlines()[-6:]
        assert any(f"rank 1 exited after all_reduce #3 on group 'world'; {wait(others(n))} in all_reduce #4"
                   in line for line in head), f[r]


@pytest.mark.parametrize("n", [2, 4])
def test_sigint_on_one_rank(n, tmp_path):
    f = ended(run(n, "sigint", tmp_path), "sigint")
    assert "KeyboardInterrupt" in f[1]
    for r in others(n):        # (rarely the launcher's own SIGINT reaches a second rank as the job ends)
        assert re.search(r"ranks? (\d, )*1(, \d)* failed \(KeyboardInterrupt \(SIGINT\)\)", f[r]), f[r]


@pytest.mark.parametrize("n", [2, 4])
def test_one_collective_too_many(n, tmp_path):
    f = ended(run(n, "extra", tmp_path), "extra")
    assert f"{names(others(n, 0))} exited after all_reduce #3 on group 'world'; rank 0 waits in all_reduce #4" in f[0]


@pytest.mark.parametrize("n", [2, 4])
def test_sigkill_ends_the_job(n, tmp_path):
    res = run(n, "sigkill", tmp_path)
    assert res.rc not in (0, None) and res.seconds < LIMIT


@pytest.mark.parametrize("n", [2, 4])
def test_watchdog_rollcall_on_timeout(n, tmp_path):
    f = ended(run(n, "timeout", tmp_path), "timeout")
    for r in others(n):
        assert f"all_reduce #4 on group 'world' (size=4, float64, step 0) did not complete within {TIMEOUT} s" in f[r]
        assert "rank 1: no answer" in f[r] and f"arrived: {', '.join(map(str, others(n)))}" in f[r]


@pytest.mark.parametrize("n", [2, 4])
def test_async_op_the_others_never_issue(n, tmp_path):
    f = ended(run(n, "async_skip", tmp_path), "async_skip")
    for r in range(n):
        assert "CollectiveMismatchError" in f[r] and "ranks disagree on op" in f[r]
        assert "async_op: " in f[r] and "rank 1 = True" in f[r]


@pytest.mark.parametrize("n", [2, 4])
def test_async_never_waited(n, tmp_path):
    f = ended(run(n, "async_unwaited", tmp_path), "async_unwaited")
    for r in range(n):
        assert "async all_reduce #4 on group 'world' was never waited on" in f[r], f[r]
        # the headline names the rank that dropped it, the agreeing ranks share one line
        head = next(ln for ln in f[r].splitlines() if "CollectiveMismatchError:" in ln)
        assert "): rank 1: async all_reduce #4 on group 'world' was never waited on" in head, head
        assert "invalid arguments" not in f[r] and f"{names(others(n))}: barrier #5" in f[r], f[r]


def test_async_never_waited_at_exit(tmp_path):
    f = ended(run(2, "async_unwaited_exit", tmp_path), "async_unwaited_exit")
    assert "async all_reduce #4 on group 'world' was never waited on" in f[1], f


@pytest.mark.parametrize("n", [2, 4])
def test_group_usable_after_async_mismatch(n, tmp_path):
    res = run(n, "async_after_mismatch", tmp_path)
    assert res.rc == 0, res.out[-3000:]
    got = reports(res.out)
    assert sorted(g["rank"] for g in got) == list(range(n))
    for g in got:
        assert "ranks disagree on async_op" in g["caught"]
        assert g["sum"] == n * (n + 1) / 2 and g["bcast"] == n - 1


@pytest.mark.parametrize("n", [2, 4])
def test_async_on_a_temporary_buffer(n, tmp_path):
    res = run(n, "temp_buffer", tmp_path)
    assert res.rc == 0, res.out[-3000:]
    got = reports(res.out)
    assert len(got) == n and all(g["alive"] and g["value"] == g["expect"] for g in got)


@pytest.mark.parametrize("n", [2, 4])
def test_object_collective_mismatch(n, tmp_path):
    f = ended(run(n, "object_mismatch", tmp_path), "object_mismatch")
    for r in range(n):
        assert "broadcast_object #4 on group 'world'" in f[r] and "ranks disagree on root" in f[r]
        assert f"root: {names(others(n))} = 0; rank 1 = 1" in f[r], f[r]


@pytest.mark.cores("all")      # timing-sensitive: alone under pytest-xdist (tests/conftest.py)
def test_subgroup_mismatch_ends_every_rank(tmp_path):
    """DeviceMesh(dp=2, tp=2): ranks 0, 1 disagree inside their tp group; ranks 2, 3
    wait in a world barrier and end too, naming the failing world ranks."""
    f = ended(run(4, "subgroup", tmp_path), "subgroup")
    for r in (0, 1):
        assert "all_reduce #1 on group 'tp' (2 ranks, world ranks [0, 1]): ranks disagree on size" in f[r]
        assert "size: rank 0 = 8; rank 1 = 10" in f[r]
    for r in (2, 3):
        assert "ranks 0, 1 failed (CollectiveMismatchError: all_reduce #1 on group 'tp'" in f[r], f[r]
        assert "ranks 2, 3 wait in barrier" in f[r]


@pytest.mark.parametrize("n", [2, 4])
def test_skipped_step(n, tmp_path):
    f = ended(run(n, "skipped_step", tmp_path), "skipped_step")
    for r in range(n):
        assert "ranks disagree on step" in f[r]
        expect = ("rank 0 is at step 3; rank 1 at step 4" if n == 2 else    # a tie: in rank order
                  f"rank 1 is at step 4; {names(others(n))} at step 3")     # the odd one out first
        assert expect in f[r], f[r]


@pytest.mark.parametrize("n", [2, 4])
def test_clean_exit_is_quick_and_zero(n, tmp_path):
    res = run(n, "clean", tmp_path)
    assert res.rc == 0 and len(reports(res.out)) == n and res.seconds < LIMIT
    assert not list(tmp_path.iterdir())                    # no flight dump on success


@pytest.mark.parametrize("env_timeout,expect", [(None, 2), ("1", 1)])
def test_init_timeout_and_env_override(env_timeout, expect, tmp_path):
    """comm.init(timeout=2) sets the deadline; PDIST_TIMEOUT, when set, wins (1 s: the shorter
    awaits less; a deadline met early on a loaded box still names PDIST_TIMEOUT's 1 s)."""
    f = ended(run(2, "timeout", tmp_path, env={"PDIST_TIMEOUT": env_timeout, "FAIL_INIT_TIMEOUT": "2"}), "timeout")
    assert f"did not complete within {expect} s (PDIST_TIMEOUT)" in f[0], f[0]


def test_dtype_aliases_match(tmp_path):
    from pdist.comm.check import dtype_code
    assert dtype_code(np.dtype(np.int64)) == dtype_code(np.dtype(np.longlong))
    assert dtype_code(np.dtype(np.int32)) != dtype_code(np.dtype(np.float32))
    res = run(2, "dtype_alias", tmp_path)
    assert res.rc == 0 and [g["sum"] for g in reports(res.out)] == [3, 3]


def test_user_blas_threads_stand(tmp_path):
    res = run(2, "threads", tmp_path, env={"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"})
    assert res.rc == 0
    assert all(set(g["blas"]) <= {2} for g in reports(res.out)), res.out


def test_trace_imports_no_comm():
    code = "import sys, pdist.measure.trace; assert 'pdist.comm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_poll_has_a_deadline(monkeypatch):
    """The generic wait (CUDA events use it) raises at its deadline."""
    from pdist.comm import watchdog
    monkeypatch.setitem(watchdog._S, "timeout", 0.05)
    with pytest.raises(watchdog.CollectiveTimeoutError, match="did not complete within 0.05 s"):
        watchdog.poll(lambda: False)


def test_flight_dumps_go_to_a_temp_dir_not_the_checkout(tmp_path):
    """Without PDIST_FLIGHT_DIR (a student running exercise 10 by hand) the dumps go to
    <tmp>/pdist-flight-<uid>, never the current directory, and the report names the file."""
    tmp, here = tmp_path / "tmp", Path.cwd() / "pdist_flight_rank1.json"
    tmp.mkdir()
    before = here.stat().st_mtime if here.exists() else None
    res = launch(2, W / "fail_cases.py", "exception", timeout=60, wrap=False,
                 env={"PDIST_TIMEOUT": str(TIMEOUT), "PDIST_FLIGHT_DIR": None, "TMPDIR": str(tmp)})
    f = ended(res, "exception")
    dump = tmp / f"pdist-flight-{os.getuid()}" / "pdist_flight_rank1.json"
    assert json.loads(dump.read_text())["rank"] == 1
    assert f"flight recorder: {dump}" in f[1], f[1]
    assert (here.stat().st_mtime if here.exists() else None) == before, "a dump was written to the cwd"
