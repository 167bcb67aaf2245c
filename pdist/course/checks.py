"""The checks of each course exercise, run under mpiexec by the grader (pdist/course/grade.py).

    python -m pdist.testing pdist/course/checks.py EXERCISE SOURCE

SOURCE is a student's exercise file, or ``reference`` (pdist/course/solutions.py).
Every check compares the student's function, plugged into pdist's machinery, with pdist's
own implementation: equality with single-process training (float64, rtol 1e-9), bytes
sent (``group.stats``, the ring accounting of docs/design.md), no hang (the watchdog,
``PDIST_TIMEOUT``). Each rank prints one ``report`` per check; on the first failure it
reports why and exits, so the grader (which reads the reports) shows the first failing
check. Messages say what differs, never what the answer is.
"""
import os
import sys
import time
import traceback


from pdist.course import checks_data as grade_checks_data, checks_model as grade_checks_model
from pdist.course.common import CheckFailed, load

CHECKS = {f"{i:02d}": getattr(grade_checks_data if i <= 5 else grade_checks_model, f"checks_{i:02d}")
          for i in range(1, 11)}


def main(exercise, source):
    from pdist import comm
    from pdist.engine.backend import set_default_dtype
    from pdist.testing import report
    set_default_dtype("float64")
    world = comm.init()
    try:
        S = load(source)
        checks = CHECKS[exercise](S, world)
    except Exception as e:
        report(exercise=exercise, index=-1, check="loads", ok=False, rank=world.rank,
               msg=f"the exercise file does not load: {type(e).__name__}: {e}")
        _stop()
    for i, (name, fn) in enumerate(checks):
        t0 = time.perf_counter()
        try:
            fn()
        except NotImplementedError as e:
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank, kind="todo",
                   msg=f"not written yet ({e})")
            _stop()
        except CheckFailed as e:
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank, msg=str(e))
            _stop()
        except comm.CollectiveTimeoutError as e:
            head = str(e).splitlines()[0]
            where = head.split(" did not complete")[0] if e.reason == "timeout" else head
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank, kind="timeout",
                   reason=e.reason, where=where, msg=head)
            _stop()
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)
            at = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                       if "student_exercise" in f.filename or f.filename == os.path.abspath(source)), "")
            first = (str(e).splitlines() or [""])[0]
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank,
                   msg=f"raised {type(e).__name__}: {first}" + (f" ({at})" if at else ""))
            _stop()
        report(exercise=exercise, index=i, check=name, ok=True, rank=world.rank,
               seconds=round(time.perf_counter() - t0, 3))
    report(exercise=exercise, done=True, rank=world.rank, checks=len(checks))


def _stop():
    """This rank has reported its failure: give the others a moment to report theirs
    (ranks in one deadlock time out together), then end the job without the exit hooks."""
    sys.stdout.flush()
    time.sleep(0.5)
    os._exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
