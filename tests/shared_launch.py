"""One launch for several tests: ``mpirun_shared(n, script, *args, timeout=, env=)`` is
``pdist.testing.mpirun`` run once per suite for every test that asks with the same arguments
(in this process and across pytest-xdist's workers), and ``world(n, request)`` builds on it:
a test module gives its jobs at n ranks (``suite_jobs`` or ``SUITE_JOBS``), run as one launch
of tests/workers/jobs.py, its module's own or the suite's at n, and each test asserts its own
part of the output (``own``: its job's reports; ``text``: what its job printed).

A launch that failed fails every test that shares it, each with the failing rank's traceback
(the first caller's MPIRunError message, replayed). Across xdist's workers the outcome is a
file under a lock beside the rank units' pool (tests/conftest.py, whose controller removes
them at its end), named by the launch's arguments: the first worker to ask runs the launch
holding the lock; a worker that finds the lock taken waits for it holding none of its rank
units (so it never keeps the launch it waits for from starting), then reads the outcome. A
worker killed in the middle leaves no outcome: the next one to ask runs the launch. Without
xdist the outcome is kept in this process only.

``jobs({name: [script, *args]})``: the arguments that run several scripts in one launch
(tests/workers/jobs.py), ``stops(script, *args)`` one of them expected to stop;
``world(n, request)``: the launch at n ranks of a module's jobs (``suite_jobs``), shared;
``own(request, out)``, ``text(request, out)``: a job's reports, its rank 0's text;
``selected(request)``: the tests of the module this session runs; ``scratch(name)``: a path
for a file a job writes; ``session()``: the suite's run."""
import atexit
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile

from pdist.testing import REPORT_PREFIX, MPIRunError, mpirun, reports

# The sizes at which every module's jobs share one launch (``world``): a process has a bounded
# number of MPI communicators (MPICH: 2048 context ids) and pdist's groups keep theirs (3 per
# group), so the 2- and 4-rank jobs of the big modules (hundreds of groups each) keep a launch
# per module; a small module joins at every size (``SUITE_AT``).
SHARED_SIZES = (1, 3, 8)
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


def chosen(spec, names, n=None):
    """The jobs of ``spec`` ({name: job}) named after a test in ``names``; with ``n``, spec's values
    are (world size, job): those at n."""
    if n is not None:
        spec = {name: job for name, (size, job) in spec.items() if size == n}
    return {name: job for name, job in spec.items() if name in names}


def world(n, request, timeout=540):
    """The output of this test's launch at n ranks (``mpirun_shared``), which runs the jobs at n
    of its module, ``suite_jobs(n, names)`` ({name: job} for ``names``, its tests that this
    session runs) or ``SUITE_JOBS`` ({test name: (n, job)}): the suite's launch at n, which every
    module that joins at n shares (in the session's order), or at a size its module does not join
    (``SUITE_AT``, default SHARED_SIZES) the module's own. A job's name is its module's path, "::"
    and the name it gave (a name that starts with "::", a job that modules share, as is); ``own``
    and ``text`` read them back. A job that fails fails every test that reads the launch: run a
    test alone (its launch then holds its jobs only) to see it apart."""
    def joins(mod):
        return n in getattr(mod, "SUITE_AT", SHARED_SIZES)
    spec, names = {}, {}
    for it in request.session.items:
        mod = it.module
        if hasattr(mod, "suite_jobs") or hasattr(mod, "SUITE_JOBS"):
            if mod is request.module or joins(mod) and joins(request.module):
                names.setdefault(mod, (it.nodeid.split("::")[0], set()))[1].add(it.name)
    for mod, (path, held) in names.items():
        given = mod.suite_jobs(n, held) if hasattr(mod, "suite_jobs") else chosen(mod.SUITE_JOBS, held, n)
        spec |= {name if name.startswith("::") else f"{path}::{name}": job for name, job in given.items()}
    return mpirun_shared(n, *jobs(spec), timeout=timeout)


def _job(request, job):
    name = job or request.node.name
    return name if name.startswith("::") else f"{request.node.nodeid.split('::')[0]}::{name}"


def own(request, out, job=None):
    """The reports of job ``job`` of ``request``'s module in ``world``'s output (default: the job
    named after the test)."""
    return reports(out, job=_job(request, job))


def text(request, out, job=None):
    """What rank 0 printed in job ``job`` of ``request``'s module (default: the test's), with what
    other ranks printed meanwhile: from its ``[pdist job] NAME`` line to the next job's, without
    the report lines (``own`` reads a job's; other ranks may still print the last job's)."""
    name = _job(request, job)
    parts = out.split("[pdist job] ")
    mine = [p.split("\n", 1)[1] for p in parts[1:] if p.split("\n", 1)[0] == name]
    assert len(mine) == 1, f"job {name!r} did not run (or ran twice)\n{out[-3000:]}"
    return "\n".join(line for line in mine[0].split("\n") if REPORT_PREFIX not in line)


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
