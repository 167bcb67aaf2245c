"""Several worker scripts (or lessons) in one launch, each a *job* run in turn as ``__main__``
with its own ``sys.argv``, as ``mpiexec -n N python SCRIPT ARGS`` runs it alone: one start-up
of mpiexec and one import of pdist per rank for all of them.

    mpiexec -n 2 python -m pdist.testing tests/workers/jobs.py \\
        '{"low": ["tests/workers/comm_low_precision.py"], "bad": {"argv": ["lessons/06_mesh.py", "--tp", "3"], "stops": true}}'

Tests build that argument with ``shared_launch.jobs`` and read a job's reports with
``pdist.testing.reports(out, job=NAME)`` (``report()`` tags them with the running job's name);
rank 0 prints ``[pdist job] NAME`` before each job (``shared_launch.job_output`` cuts rank 0's
text there). After each job the process-wide settings go back to a fresh process's: the
default dtype (workers set their own; lessons rely on the default), the step stamps of the
collectives' fingerprints (a job that stopped inside a step leaves that step's number and its
batch's hash) and the injected faults (a lesson's ``--inject``). A job that raises or exits non-zero ends the launch with that rank's traceback,
the job named in it (pdist.testing's failure report); one that exits 0 lets the next one run.

A job given as ``{"argv": [...], "stops": true}`` (``shared_launch.stops``) is one expected to
stop on every rank before any work, with a usage error (``SystemExit``) or an exception (a bad
layout's ValueError), which the launch survives by design: its output is captured, each rank
reports ``code`` (its exit code: 0 if it ran to the end, 1 for an exception), ``error`` (the
exception, or None) and ``out`` (what it printed, stdout and stderr); the ranks then meet in one
collective with a deadline of STOP_S: a rank that did not stop (it went on into the job's work)
ends the launch there, the watchdog naming where it waits, instead of at the harness's timeout."""
import contextlib
import io
import json
import os
import runpy
import sys
from pathlib import Path

from pdist import comm, testing
from pdist.comm import flight_recorder, watchdog
from pdist.engine import backend

JOBS = json.loads(sys.argv[1])
DTYPE = backend.default_dtype()
STOP_S = 30         # s: how long the ranks wait for each other after a job that stops (it stops at once)
RANK = int(next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if v in os.environ), 0))


def run(name, script, *args):
    """``script`` as ``__main__`` with ``sys.argv = [script, *args]`` and its folder first on
    ``sys.path`` (as ``python script`` has it); ``testing.JOB`` names the job meanwhile."""
    sys.argv, folder = [script, *args], str(Path(script).resolve().parent)
    sys.path.insert(0, folder)
    testing.JOB[0] = name
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise SystemExit(f"job {name!r}: {script} exited with {e.code}") from e
    except BaseException as e:            # its own type (a peer's failure reads as one), the job noted
        if hasattr(e, "add_note"):        # Python 3.11+; before, the traceback's frames name the script
            e.add_note(f"(in job {name!r}: {script})")
        raise
    finally:
        testing.JOB[0] = None
        sys.path.remove(folder)
        backend.set_default_dtype(DTYPE)
        flight_recorder.set_step(0, batch=0)
        if "pdist.faults.inject" in sys.modules:      # a lesson's --inject must not fire in the next job
            sys.modules["pdist.faults.inject"].clear()


def stopped(name, script, *args):
    """``run`` a job expected to stop at once on every rank, its output captured; report how it stopped."""
    buf, code, error = io.StringIO(), 0, None
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            run(name, script, *args)
    except SystemExit as e:
        code = e.__cause__.code if isinstance(e.__cause__, SystemExit) else e.code   # run() names the job
    except Exception as e:
        code, error = 1, f"{type(e).__name__}: {e}"
    testing.JOB[0] = name
    testing.report(rank=RANK, code=code, error=error, out=buf.getvalue())
    testing.JOB[0] = None
    world, deadline = comm.init(), watchdog.timeout()
    watchdog.configure(STOP_S)                         # (PDIST_TIMEOUT, when set, wins)
    try:                                               # every rank stopped: none went on into the job
        world.all_gather_object(code)
    finally:
        watchdog.configure(deadline)


for name, job in JOBS.items():
    if RANK == 0:                                     # one write: no other rank's output inside the line
        sys.stdout.write(f"[pdist job] {name}\n")
        sys.stdout.flush()
    if isinstance(job, dict):
        stopped(name, *map(str, job["argv"]))
    else:
        run(name, *map(str, job))
