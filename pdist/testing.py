"""Run a script under a real ``mpiexec -n N`` and report which rank failed.

Tests and graders use one function:

    from pdist.testing import mpirun
    out = mpirun(4, "tests/workers/dp_equiv.py", "--stage", "2", timeout=120)

It launches the ``mpiexec`` that sits beside ``sys.executable`` (the venv's, from
the ``mpich`` wheel), closes stdin, applies a timeout, and runs the script
through ``python -m pdist.testing`` so that an exception on any rank prints
``[rank r] Traceback ...`` and aborts the whole job at once (no hang while the
other ranks wait in a collective). On failure it raises ``MPIRunError`` whose
message names the failing rank(s) and shows their traceback. World size 1 runs
the script without mpiexec.
"""
import os
import re
import runpy
import shutil
import subprocess
import sys
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
        raise MPIRunError("no mpiexec found: pip install mpich (or load your cluster's MPI)")
    return found


def mpirun(n, script, *args, timeout=180, env=None, check=True):
    """Run ``python script args`` on ``n`` ranks; return combined stdout+stderr.

    Raises MPIRunError (with the failing ranks' tracebacks) on a non-zero exit or
    on timeout when ``check`` is true.
    """
    script = str(script)
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    repo = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = repo + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    py = [sys.executable, "-u", "-m", "pdist.testing", script, *map(str, args)]
    cmd = py if n == 1 else [mpiexec_path(), "-n", str(n), *py]
    # own session: on timeout the whole launch (mpiexec, proxies, ranks) is killed
    # by its process group, never by a name pattern
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=full_env, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        raise MPIRunError(f"mpirun -n {n} {script} timed out after {timeout}s "
                          f"(a rank is stuck; a collective mismatch?)\n--- output ---\n{(out or '')[-6000:]}")
    if check and proc.returncode != 0:
        raise MPIRunError(_failure_message(n, script, proc.returncode, out))
    return out


REPORT_PREFIX = "[pdist report] "


def report(**results):
    """Print one JSON object of a worker's results (a test reads them back with
    ``reports(out)``; every value must be JSON-serialisable). Any rank may call it;
    include ``rank=`` when the rank matters."""
    import json
    print(REPORT_PREFIX + json.dumps(results, sort_keys=True), flush=True)


def reports(out):
    """Every JSON object that ``report()`` printed in a run's output, in order (ranks
    printing at once may share a line: each object is decoded where its prefix starts)."""
    import json
    dec = json.JSONDecoder()
    return [dec.raw_decode(part.lstrip())[0] for part in out.split(REPORT_PREFIX)[1:]]


def _failure_message(n, script, rc, out):
    failed = sorted(set(int(r) for r in re.findall(r"\[pdist rank (\d+) FAILED\]", out)))
    head = f"mpirun -n {n} {script} exited with {rc}"
    if failed:
        head += f"; failing rank(s): {failed}"
    blocks = re.findall(r"\[pdist rank \d+ FAILED\].*?\[pdist rank \d+ END\]", out, flags=re.S)
    body = "\n".join(blocks) if blocks else out[-6000:]
    if blocks and all("Traceback" not in b for b in blocks):   # e.g. SystemExit(2) after a usage error
        body += "\n--- output ---\n" + out[-3000:]
    return head + "\n" + body


def _kill_group(proc):
    """SIGKILL the launch's process group (mpiexec and the ranks it started)."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
        _abort(traceback.format_exc())


def _abort(text):
    r = _world_rank()
    sys.stdout.flush()
    sys.stderr.write(f"[pdist rank {r} FAILED]\n{text}\n[pdist rank {r} END]\n")
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)
    os._exit(1)


if __name__ == "__main__":
    _main(sys.argv[1:])
