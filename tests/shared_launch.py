"""One launch for several tests: ``mpirun_shared(n, script, *args, timeout=, env=)`` is
``pdist.testing.mpirun`` run once per suite for every test that asks with the same arguments
(in this process and across pytest-xdist's workers), so a module's tests at one world size
share one world and each asserts its own part of the output (``reports(out, job=NAME)``).

A launch that failed fails every test that shares it, each with the failing rank's traceback
(the first caller's MPIRunError message, replayed). Across xdist's workers the outcome is a
file under a lock beside the rank units' pool (tests/conftest.py, whose controller removes
them at its end), named by the launch's arguments: the first worker to ask runs the launch
holding the lock; a worker that finds the lock taken waits for it holding none of its rank
units (so it never keeps the launch it waits for from starting), then reads the outcome. A
worker killed in the middle leaves no outcome: the next one to ask runs the launch. Without
xdist the outcome is kept in this process only.

``jobs({name: [script, *args]})``: the arguments that run several scripts in one launch
(tests/workers/jobs.py), ``stops(script, *args)`` one of them expected to stop; ``scratch(name)``: a path for a file one of them writes;
``selected(request)``: the tests of the module this session runs; ``chosen(request, spec)``:
the jobs named after them; ``suite_world(n, request)``: one launch for several modules' jobs;
``own(request, out)``: the reports of the test's own job;
``job_output(out, name)``: rank 0's text of one of them; ``session()``: the suite's run."""
import atexit
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile

from pdist.testing import MPIRunError, mpirun, reports

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "jobs.py")
_done = {}                                    # key -> outcome, in this process
_folder = []                                  # scratch()'s folder without xdist


def stops(script, *args):
    """A job expected to stop on every rank before any work (a usage error, a bad layout): its
    output captured and reported per rank (``code``, ``error``, ``out``), the launch going on."""
    return {"argv": [script, *args], "stops": True}


def jobs(spec):
    """``mpirun_shared(n, *jobs({"a": [script, arg, ...], ...}))``: every script in one launch
    (a job may be ``stops(script, ...)``)."""
    def strs(job):
        return {**job, "argv": strs(job["argv"])} if isinstance(job, dict) else [str(a) for a in job]
    return RUNNER, json.dumps({name: strs(job) for name, job in spec.items()})


def session():
    """The suite's run: the xdist controller's pid (tests/conftest.py), else this process's."""
    return getattr(sys.modules.get("conftest"), "RUN", None) or os.getpid()


def scratch(name):
    """A path that every worker sees, for a file a shared launch writes (a lesson's ``--json``):
    beside the pool's file under xdist (removed with it), else in a folder of this process's,
    removed at its exit."""
    pool = sys.modules.get("conftest")
    if getattr(pool, "RUN", None) is not None:
        return f"{pool._path(pool.RUN)}.{name}"
    if not _folder:
        _folder.append(tempfile.mkdtemp(prefix="pdist-test-"))
        atexit.register(shutil.rmtree, _folder[0], True)
    return os.path.join(_folder[0], name)


def selected(request):
    """The names ("test_x[n2]") of the tests of ``request``'s module that this session runs:
    a shared launch runs the cases of these only, not those ``-m "not slow"`` or ``-k`` left out."""
    return {it.name for it in request.session.items if it.module is request.module}


def chosen(request, spec, n=None):
    """The jobs of ``spec`` ({name: [script, *args]}) named after a test of ``request``'s module
    that this session runs (``selected``; the test reads its job with ``own``). With ``n``,
    spec's values are (world size, job): the jobs at n."""
    names = selected(request)
    if n is not None:
        spec = {name: job for name, (size, job) in spec.items() if size == n}
    return {name: job for name, job in spec.items() if name in names}


def own(request, out):
    """The reports of the job named after ``request``'s test (``chosen``; ``suite_world``: its node id)."""
    return [{k: v for k, v in r.items() if k != "job"} for r in reports(out)
            if r.get("job") in (request.node.name, request.node.nodeid)]


def suite_world(n, request, timeout=540):
    """The one launch at n ranks of the whole session for the modules that define
    ``suite_jobs(n, names)`` (their jobs at n, ``{test name: job}``, for ``names``, their tests
    that this session runs): every such module's jobs in the session's order, each named by its
    test's node id (``own``, ``job_output(out, request.node.nodeid)`` read them). Small modules
    of one launch per world size share it; a job that fails fails the tests of them all."""
    spec, names = {}, {}
    for it in request.session.items:
        if hasattr(it.module, "suite_jobs"):
            names.setdefault(it.module, (it.nodeid.split("::")[0], set()))[1].add(it.name)
    for mod, (path, held) in names.items():
        spec |= {f"{path}::{test}": job for test, job in mod.suite_jobs(n, held).items()}
    return mpirun_shared(n, *jobs(spec), timeout=timeout)


def job_output(out, name):
    """Rank 0's output of job ``name`` (with what other ranks printed meanwhile): from its
    ``[pdist job] NAME`` line to the next job's."""
    parts = out.split("[pdist job] ")
    mine = [p.split("\n", 1)[1] for p in parts[1:] if p.split("\n", 1)[0] == name]
    assert len(mine) == 1, f"job {name!r} did not run (or ran twice)\n{out[-3000:]}"
    return mine[0]


def mpirun_shared(n, script, *args, timeout=180, env=None):
    """``mpirun(n, script, *args, ...)``'s output, run once for every caller with these
    arguments; raises its MPIRunError (the failing rank's traceback) in every one of them."""
    call = [n, str(script), [str(a) for a in args], timeout, sorted((env or {}).items())]
    key = hashlib.sha256(json.dumps(call).encode()).hexdigest()[:20]
    if key not in _done:
        _done[key] = _outcome(key, lambda: _run(n, script, args, timeout, env))
    if "error" in _done[key]:
        raise MPIRunError(f"(a launch shared with other tests)\n{_done[key]['error']}")
    return _done[key]["out"]


def _run(n, script, args, timeout, env):
    try:
        return {"out": mpirun(n, script, *args, timeout=timeout, env=env)}
    except MPIRunError as e:
        return {"error": str(e)}


def _outcome(key, run):
    """The outcome stored by whichever worker ran it first, else ``run()``'s, stored."""
    pool = sys.modules.get("conftest")        # tests/conftest.py: the run's name and its units
    if getattr(pool, "RUN", None) is None:
        return run()
    path = f"{pool._path(pool.RUN)}.shared-{key}"      # beside the pool's file: removed with it
    with open(path + ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:               # another worker runs it: wait holding no unit
            with pool.holding(0, exactly=True):
                fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
        res = run()
        with open(path + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(path + ".tmp", path)       # whole or absent, for a reader
        return res
