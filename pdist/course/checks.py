"""The checks of each course exercise, run under mpiexec by the grader (pdist/course/grade.py).

    python -m pdist.testing pdist/course/checks.py EXERCISE SOURCE

SOURCE is a student's exercise file, or ``reference`` (pdist/course/solutions.py).
Every check compares the student's function, plugged into pdist's machinery, with pdist's
own implementation: equality with single-process training (float64, rtol 1e-9), bytes
sent (``group.stats``, the ring accounting of docs/design.md), no hang (the watchdog,
``PDIST_TIMEOUT``). Each rank sends one signed report per check on the grader's channel
(pdist/course/channel.py; never stdout); on the first failure it reports why (``msg``: one
line; ``detail``: the full error, e.g. the watchdog's roll-call or the student's traceback)
and exits, so the grader shows the first failing check. Messages say what differs, never
what the answer is.
"""
import os
import sys
import time
import traceback


from pdist.course import checks_data as grade_checks_data, checks_model as grade_checks_model
from pdist.course import checks_cp as grade_checks_cp, checks_sched as grade_checks_sched
from pdist.course import checks_moe as grade_checks_moe
from pdist.course.common import CheckFailed, load

CHECKS = {f"{i:02d}": getattr(grade_checks_data if i <= 5 else grade_checks_model, f"checks_{i:02d}")
          for i in range(1, 11)}
CHECKS["11"] = grade_checks_cp.checks_11
CHECKS["13"] = grade_checks_sched.checks_13
CHECKS["12"] = grade_checks_moe.checks_12


def main(exercise, source):
    from pdist.course.channel import Reporter
    from pdist.testing import _world_rank
    rep = Reporter.from_env(_world_rank())      # the key leaves the environment before any student code
    from pdist import comm
    from pdist.engine.backend import set_default_dtype
    set_default_dtype("float64")
    world = comm.init()
    if world.size > 1:          # every rank has taken (and deleted) its key before any student code runs
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
    if run_checks(exercise, source, world, lambda **kw: rep.report(exercise=exercise, rank=world.rank, **kw)):
        _stop()


def run_checks(exercise, source, world, report):
    """Load ``source`` and run the exercise's checks on ``world`` in order, one report per
    check; returns None when all passed (then a ``done`` report), else the failed check's
    report fields (reported, and this rank stops checking)."""
    from pdist import comm
    from pdist.engine.backend import set_default_dtype
    set_default_dtype("float64")
    try:
        S = load(source)
        checks = CHECKS[exercise](S, world)
    except BaseException as e:   # SystemExit too: a module that exits while loading
        fields = dict(index=-1, check="loads", ok=False, msg=f"the exercise file does not load: {_one_line(e)}",
                      detail=student_traceback(e, source))
        report(**fields)
        return fields
    for i, (name, fn) in enumerate(checks):
        t0 = time.perf_counter()
        try:
            fn()
        except BaseException as e:
            fields = dict(index=i, check=name, ok=False, seconds=round(time.perf_counter() - t0, 3),
                          **failure(e, source, comm.CollectiveTimeoutError))
            report(**fields)
            return fields
        report(index=i, check=name, ok=True, seconds=round(time.perf_counter() - t0, 3))
    report(done=True, checks=len(checks))
    return None


def failure(e, source, timeout_error):
    """The report fields of a failed check: ``msg`` (one line), ``detail`` (all of it)."""
    if isinstance(e, NotImplementedError):
        return dict(kind="todo", msg=f"not written yet ({e})", detail="")
    if isinstance(e, CheckFailed):
        msg = (str(e).splitlines() or [""])[0]
        return dict(msg=msg, detail=getattr(e, "detail", "") or str(e))
    if isinstance(e, timeout_error):
        head = (str(e).splitlines() or [""])[0]
        where = head.split(" did not complete")[0] if e.reason == "timeout" else head
        return dict(kind="timeout", reason=e.reason, where=where, msg=head, detail=str(e))
    tb = traceback.extract_tb(e.__traceback__)
    at = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb) if _is_student(f, source)), "")
    why = next((ln.split("  <- ", 1)[1] for ln in str(e).splitlines() if "  <- " in ln), "")  # a rank's reason
    return dict(msg=f"raised {_one_line(e)}" + (f": {why}" if why else "") + (f" ({at})" if at else ""),
                detail=student_traceback(e, source))


def _one_line(e):
    return f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0]


def _is_student(frame, source):
    return "student_exercise" in frame.filename or (source != "reference"
                                                     and frame.filename == os.path.abspath(source))


def student_traceback(e, source):
    """The traceback restricted to the student's frames (all frames when none is), then the
    exception's full message."""
    tb = traceback.extract_tb(e.__traceback__)
    mine = [f for f in tb if _is_student(f, source)] or list(tb)
    lines = ["Traceback (your code's frames):"] + [ln.rstrip() for ln in traceback.format_list(mine)]
    return "\n".join(lines + [f"{type(e).__name__}: {e}"])


def _stop():
    """This rank has reported its failure: give the others a moment to report theirs
    (ranks in one deadlock time out together), then end the job without the exit hooks."""
    sys.stdout.flush()
    time.sleep(0.5)
    os._exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
