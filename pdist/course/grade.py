"""The course's autograder: ``make grade``, ``python -m pdist.grade [EXERCISE ...]``.

    python -m pdist.grade                  # grade lessons/exercises/ (every exercise)
    python -m pdist.grade 01 03            # only these (number, or a file name's start)
    python -m pdist.grade --reference      # the library's own answers: full points (CI)
    python -m pdist.grade --dir PATH       # grade the exercise files in another folder
    python -m pdist.grade --json           # machine-readable scores, with each check's full detail
    python -m pdist.grade --verbose        # every check of every exercise, passed ones with their time
    python -m pdist.grade --class DIR [--json] [--csv OUT.csv]   # one subfolder per student

An exercise whose functions all still raise ``NotImplementedError("exercise: ...")`` is
"not started" and is never launched (a fresh clone grades in about a second). Any other
is screened first (pdist/course/screening.py: a misnamed, unreadable or unparsable file,
or one that uses the library's own answer, gets its status without a launch), then
launched under a real ``mpiexec -n N`` (pdist.testing.launch, output bounded, every process
it started killed at the end) running its checks (pdist/course/checks.py) with a small
``PDIST_TIMEOUT``, so a deadlock becomes a result: the watchdog's roll-call says where each
rank waits. Each exercise has a time cap (``CAP_S``, scaled up on a loaded machine);
results come back signed on a private channel (pdist/course/channel.py), never from
stdout. The table shows the exercise, its points, its status (not started; failing, with
the first failing check in one line; passed) and its time, then the full error of the
first failing exercise. Points are all or nothing per exercise.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from pdist import procs
from pdist.course.channel import Channel
from pdist.course.summary import json_path_problem
from pdist.course.screening import FORBIDDEN, not_started, screen  # noqa: F401 (the grader's API)
from pdist.course.verdict import deadlock_line, verdict  # noqa: F401
from pdist.testing import launch

ROOT = Path(__file__).resolve().parents[2]
EXERCISE_DIR = ROOT / "lessons" / "exercises"
CHECKS = Path(__file__).resolve().parent / "checks.py"
WATCHDOG_S = 5          # PDIST_TIMEOUT inside a graded run: a deadlock is reported after this long
MAX_OUTPUT = 512 << 10  # a graded job's output kept: its first and last 256 KiB

# (id, file, points, ranks, what it teaches)
EXERCISES = [
    ("01", "ex01_ring_allreduce.py", 9, 4, "ring all-reduce over isend/irecv"),
    ("02", "ex02_data_parallel.py", 8, 3, "data parallelism by hand"),
    ("03", "ex03_bucketed_ddp.py", 10, 3, "bucketed DDP with overlap"),
    ("04", "ex04_zero1.py", 9, 3, "ZeRO-1"),
    ("05", "ex05_zero3_unit.py", 10, 3, "ZeRO-3 for one unit"),
    ("06", "ex06_tensor_parallel.py", 9, 4, "Column/RowParallelLinear"),
    ("07", "ex07_vocab_parallel_ce.py", 9, 3, "vocab-parallel cross-entropy"),
    ("08", "ex08_one_f_one_b.py", 6, 1, "the 1F1B schedule as data"),
    ("09", "ex09_resharding.py", 8, 1, "resharding reads"),
    ("10", "ex10_find_the_hang.py", 8, 4, "find the hang"),
    ("11", "ex11_online_softmax.py", 4, 3, "the online-softmax merge of ring attention"),
    ("12", "ex12_moe_dispatch.py", 6, 4, "MoE dispatch and combine over all-to-all"),
    ("13", "ex13_zero_bubble.py", 4, 1, "the ZB-H1 schedule as data"),
]
TOTAL = sum(e[2] for e in EXERCISES)
# Each exercise's time cap on an idle machine (s): about twice its reference run's time
# plus the watchdog's 5 s (a deadlock must be reported before the cap), at most 15 s.
# Reference times (python -m pdist.grade --reference; 2026-12-01, 2 AMD EPYC cores at load
# 4.5, divided by that slowdown of 2.2): 01 3.1, 02 4.5, 03 2.4, 04 2.2, 05 2.7, 06 2.3,
# 07 2.4, 08 2.5, 09 2.4, 10 2.0 s; 13 (added later, like 08) 3.1 s at load ~6, ~1.5 s idle.
# On a loaded machine the cap grows (``cap_for``).
CAP_S = {"01": 13, "02": 15, "03": 12, "04": 12, "05": 13, "06": 12, "07": 12, "08": 10, "09": 10, "10": 13, "11": 12, "12": 13, "13": 10}
MAX_SLOWDOWN = 3.0


def cap_for(eid):
    """(cap in s, why): ``CAP_S[eid]`` times the machine's slowdown, load average / cores,
    clamped to [1, MAX_SLOWDOWN]."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    slow = min(MAX_SLOWDOWN, max(1.0, load / cores))
    base = CAP_S[eid]
    why = f"cap {base} s" + (f" x {slow:.1f} for load {load:.1f} on {cores} cores" if slow > 1 else "")
    return base * slow, why


def select(names):
    if not names:
        return list(EXERCISES)
    out = []
    for n in names:
        hit = [e for e in EXERCISES if e[0] == n.zfill(2) or e[1].startswith(n) or e[1] == n]
        if not hit:
            raise SystemExit(f"pdist.grade: no exercise {n!r}; choose from "
                             + ", ".join(e[0] for e in EXERCISES))
        out += [h for h in hit if h not in out]
    return out


def grade_one(ex, directory=None, reference=False):
    """{"exercise", "file", "points", "max", "ranks", "status", "msg", "detail", "checks",
    "seconds"} for one exercise; ``msg`` is one line, ``detail`` starts with it and goes on
    with the full error. Never raises for a bad submission."""
    eid, fname, pts, ranks, _ = ex
    res = {"exercise": eid, "file": fname, "max": pts, "points": 0, "ranks": ranks, "msg": "", "detail": "",
           "checks": []}
    t0 = time.perf_counter()
    if reference:
        source = "reference"
    else:
        path, _, problem = screen(Path(directory or EXERCISE_DIR), eid, fname, {e[1] for e in EXERCISES})
        if problem:
            return dict(res, status=problem[0], msg=problem[1], detail=problem[1],
                        seconds=round(time.perf_counter() - t0, 2))
        source = str(path.resolve())
    cap, why = cap_for(eid)
    chan = Channel()
    try:
        run = launch(ranks, CHECKS, eid, source, timeout=cap, wrap=False, max_output=MAX_OUTPUT,
                     env={"PDIST_TIMEOUT": WATCHDOG_S, "OMP_NUM_THREADS": 1, "PDIST_FLIGHT_DIR": chan.dir,
                          **chan.env(ranks)})
        reps, forged = chan.read(ranks)
    finally:
        chan.close()
        procs.kill_orphans()
    v = verdict(reps, forged, run, ranks, cap, WATCHDOG_S)
    if run.timed_out:
        v["msg"] += f" [{why}]"
    detail = v["msg"] + ("\n" + v["detail"] if v["detail"] and v["detail"].strip() not in v["msg"] else "")
    res.update(v, detail=detail if v["msg"] else "", seconds=round(time.perf_counter() - t0, 2),
               points=pts if v["status"] == "passed" else 0)
    return res


def grade(exercises, directory=None, reference=False, progress=None):
    """``grade_one`` of each exercise, in parallel up to the cores (classroom.pooled: a job
    of n ranks takes n of max(cores, largest job) slots); results in the given order."""
    from pdist.course.classroom import pooled
    results = {}

    def one(ex):
        res = results[ex[0]] = grade_one(ex, directory, reference)
        if progress:
            progress(res)
    pooled(exercises, lambda ex: ex[3], one)
    return [results[e[0]] for e in exercises]


def table(results, verbose=False):
    """The scores table; then the full detail of the first failing exercise (``verbose``:
    every check of every exercise, and every failing exercise's detail)."""
    w = max(len(r["file"]) for r in results)
    lines = [f"{'exercise':<{w}}  {'points':>7}  {'time':>6}  status"]
    for r in results:
        st = r["status"] + (f": {r['msg']}" if r.get("msg") else "")
        lines.append(f"{r['file']:<{w}}  {r['points']:>3}/{r['max']:<3}  {r['seconds']:>5.1f}s  {st}")
        if verbose:
            lines += [f"{'':<{w}}      {'ok  ' if c['ok'] else 'FAIL'} {c['check']} ({c['seconds']:.2f} s)"
                      + (f": {c['msg']}" if c.get("msg") else "") for c in r.get("checks", [])]
    got, mx = sum(r["points"] for r in results), sum(r["max"] for r in results)
    lines.append(f"{'total':<{w}}  {got:>3}/{mx:<3}")
    shown = [r for r in results if r["status"] != "passed" and "\n" in (r.get("detail") or "")]
    for r in shown if verbose else shown[:1]:
        lines += ["", f"{r['file']}: {r['status']}, in full:"] + ["    " + ln for ln in r["detail"].splitlines()]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pdist.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("exercises", nargs="*", help="exercise numbers (01..10) or file names; default: all")
    ap.add_argument("--reference", action="store_true", help="grade the library's own answers (full points)")
    ap.add_argument("--dir", help=f"folder holding the exercise files (default {EXERCISE_DIR})")
    ap.add_argument("--json", action="store_true", help="print the scores as JSON, with every check's detail")
    ap.add_argument("--verbose", "-v", action="store_true", help="show every check of every exercise")
    ap.add_argument("--class", dest="class_dir", metavar="DIR",
                    help="grade every student subfolder of DIR (a CSV on stdout, or JSON with --json)")
    ap.add_argument("--csv", metavar="PATH", help="with --class: write the CSV here")
    args = ap.parse_args(argv)
    exs = select(args.exercises)
    if args.reference:
        from pdist.course.common import NOT_IN_COPY, reference_available
        if not reference_available():
            raise SystemExit(f"pdist.grade: --reference: {NOT_IN_COPY}")
    procs.child_subreaper()       # orphans of the students' processes come back here, to be killed
    procs.install_signal_cleanup()
    if args.class_dir:
        from pdist.course.classroom import grade_class
        if not os.path.isdir(args.class_dir):
            raise SystemExit(f"pdist.grade: --class {args.class_dir}: no such folder")
        problem = args.csv and json_path_problem(args.csv)
        if problem:
            raise SystemExit(f"pdist.grade: --csv {args.csv}: {problem}; give a file in a folder you can write")
        grade_class(args.class_dir, exs, grade_one, args.csv, as_json=args.json)
        return 0
    if args.dir and not os.path.isdir(args.dir):
        raise SystemExit(f"pdist.grade: --dir {args.dir}: no such folder")
    progress = None if args.json else (lambda r: print(f"  graded {r['file']}: {r['status']}", file=sys.stderr,
                                                       flush=True))
    res = grade(exs, args.dir, args.reference, progress)
    if args.json:
        print(json.dumps({"total": sum(r["points"] for r in res), "max": sum(r["max"] for r in res),
                          "exercises": res}, indent=1))
    else:
        print(table(res, args.verbose))
    return 1 if args.reference and any(r["status"] != "passed" for r in res) else 0


if __name__ == "__main__":
    sys.exit(main())
