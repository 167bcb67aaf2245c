"""Several files of one exercise graded in one job: the test suite's way to grade its
folder of wrong answers (tests/test_grade.py) without one ``mpiexec`` start, and one import
of pdist per rank, for each file. Students and class mode never use it (grade.py's
``grade_one``: one job per file).

    grade_batch(ex, [folder, ...]) -> [result, ...]    # each as grade_one(ex, folder) returns it

Contract. Each folder is screened as ``grade_one`` screens it; the rest are launched as
``python checks_batch.py EXERCISE SOURCE ...`` (ranks, watchdog, output bound and signed
channel as for one file). On every rank, each file runs ``checks.run_checks`` (the very loop
``checks.main`` runs) on a fresh duplicate of the world communicator, made the world group
for that file, so no message of an earlier file can reach a later one. Then the ranks
*settle* on a private communicator: each says whether this file left any trace in the
watchdog (a timeout, a roll-call, a rank that failed or announced anything) or an async
operation never waited on (``failures.unwaited``, which the checks read). A rank whose
check failed waits for the others at most ``checks._stop``'s 0.5 s, as it waits today. The
job goes on to the next file only when every rank settled and none left a trace; otherwise
every rank ends the job exactly as ``checks._stop`` does, and the grader launches the files
left in a new job. So a file's verdict (``verdict.verdict``, the same function) comes from
a job in which nothing ran before it but files that ended cleanly on every rank.
"""
import os
import sys
import time
from pathlib import Path

SETTLE_S = 0.5          # a rank whose check failed waits this long for the others (checks._stop's grace)


def main(exercise, sources):
    from pdist.course.channel import Reporter
    from pdist.testing import _world_rank
    rep = Reporter.from_env(_world_rank())      # the key leaves the environment before any student code
    from mpi4py import MPI
    from pdist import comm
    from pdist.course.checks import run_checks
    from pdist.engine.backend import set_default_dtype
    set_default_dtype("float64")
    comm.init()
    ctl = MPI.COMM_WORLD.Dup()                  # the settling channel: no student code ever sees it
    ctl.Barrier()
    for i, source in enumerate(sources):
        world = _fresh_world()

        def report(**kw):
            rep.report(exercise=exercise, rank=world.rank, source=i, **kw)
        failed = run_checks(exercise, source, world, report)
        if not settle(ctl, failed):
            sys.stdout.flush()
            os._exit(3)                         # as checks._stop: end the job without the exit hooks
        report(settled=True)
    sys.stdout.flush()
    os._exit(0)           # every file settled; old groups may hold a student's unwaited Work


def _fresh_world():
    """A new duplicate of COMM_WORLD as the world group (``comm.get_world()`` and every
    default group), the step stamp back at 0."""
    from mpi4py import MPI
    from pdist.comm import flight_recorder, world as world_mod
    from pdist.comm.group import ProcessGroup
    from pdist.measure import trace
    g = ProcessGroup(MPI.COMM_WORLD.Dup(), "world")
    world_mod._world["group"] = g
    trace.set_world(g)
    flight_recorder.set_step(0)
    return g


def _trace_left(failed):
    """True when this file left anything a later file could see: a timeout or roll-call, a
    control message sent or received (the watchdog), an async op never waited on (on any
    group: ``failures.unwaited``, which exercise 03's checks read)."""
    from pdist.comm import failures, watchdog
    got = watchdog.drain()
    return bool(got or watchdog.peers() or watchdog._S["sent"] or watchdog._S["status_sent"]
                or (failed or {}).get("kind") == "timeout" or failures.unwaited())


def settle(ctl, failed):
    """True when every rank reached this point and none left a trace (``_trace_left``).
    A rank whose check failed gives up after ``SETTLE_S``; one that passed waits (the
    grader's cap bounds the job)."""
    import numpy as np
    from mpi4py import MPI
    mine = np.array([1 if _trace_left(failed) else 0], dtype=np.int64)
    worst = np.zeros(1, dtype=np.int64)
    req = ctl.Iallreduce(mine, worst, op=MPI.MAX)
    end = time.perf_counter() + SETTLE_S
    while not req.Test():
        if failed is not None and time.perf_counter() > end:
            return False
        time.sleep(0.001)
    return int(worst[0]) == 0


def grade_batch(ex, directories):
    """[``grade_one(ex, d)``-like result for each d], graded in as few jobs as the files allow."""
    from pdist.course import grade
    from pdist.course.screening import screen
    eid, fname, pts, ranks, _ = ex
    results, todo = {}, []
    for d in directories:
        path, _, problem = screen(Path(d), eid, fname, {e[1] for e in grade.EXERCISES})
        if problem:
            results[d] = dict(_blank(ex), status=problem[0], msg=problem[1], detail=problem[1], seconds=0.0)
        else:
            todo.append((d, str(path.resolve())))
    while todo:
        done = _one_job(ex, todo)
        results.update(done)
        todo = todo[len(done):]
    return [results[d] for d in directories]


def _blank(ex):
    eid, fname, pts, ranks, _ = ex
    return {"exercise": eid, "file": fname, "max": pts, "points": 0, "ranks": ranks, "msg": "", "detail": "",
            "checks": []}


def _one_job(ex, todo):
    """Launch the files of ``todo`` in one job; {folder: result} for the leading files it
    graded (every settled one, and the one the job ended on)."""
    from pdist import procs
    from pdist.course import grade
    from pdist.course.channel import Channel
    from pdist.course.verdict import verdict
    from pdist.testing import Launch, launch
    eid, fname, pts, ranks, _ = ex
    cap, why = grade.cap_for(eid)
    chan = Channel()
    try:
        run = launch(ranks, __file__, eid, *[s for _, s in todo], timeout=cap * len(todo), wrap=False,
                     max_output=grade.MAX_OUTPUT, env={"PDIST_TIMEOUT": grade.WATCHDOG_S, "OMP_NUM_THREADS": 1,
                                                      "PDIST_FLIGHT_DIR": chan.dir, **chan.env(ranks)})
        reps, forged = chan.read(ranks)
    finally:
        chan.close()
        procs.kill_orphans()
    out = {}
    for i, (d, _) in enumerate(todo):
        mine = [r for r in reps if r.get("source") == i]
        settled = {r["rank"] for r in mine if r.get("settled")} == set(range(ranks))
        v = verdict(mine, 0 if settled else forged, Launch(0, "", 0.0) if settled else run, ranks, cap,
                    grade.WATCHDOG_S)
        if run.timed_out and not settled:
            v["msg"] += f" [{why} x {len(todo)} files]"
        detail = v["msg"] + ("\n" + v["detail"] if v["detail"] and v["detail"].strip() not in v["msg"] else "")
        out[d] = dict(_blank(ex), **dict(v, detail=detail if v["msg"] else ""),
                      points=pts if v["status"] == "passed" else 0,
                      seconds=round(sum(c["seconds"] for c in v["checks"]), 2))    # its checks' time in the job
        if not settled:
            break
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
