"""The course's autograder: ``make grade``, ``python -m pdist.grade [EXERCISE ...]``.

    python -m pdist.grade                  # grade lessons/exercises/ (every exercise)
    python -m pdist.grade 01 03            # only these (number, or a file name's start)
    python -m pdist.grade --reference      # the library's own answers: full points (CI)
    python -m pdist.grade --dir PATH       # grade the exercise files in another folder
    python -m pdist.grade --json           # machine-readable scores
    python -m pdist.grade --class DIR --csv OUT.csv   # one subfolder per student -> one CSV

An exercise whose functions all still raise ``NotImplementedError("exercise: ...")`` is
"not started" and is never launched (a fresh clone grades in about a second). Any other
is launched under a real ``mpiexec -n N`` (pdist.testing.launch) running its checks
(pdist/course/checks.py) with a small ``PDIST_TIMEOUT``, so a deadlock becomes a result:
the watchdog's roll-call says where each rank waits. The table shows the exercise, its
points, its status (not started; failing, with the first failing check in one line;
passed) and its time. Points are all or nothing per exercise.
"""
import argparse
import ast
import csv
import json
import os
import sys
import time
from pathlib import Path

from pdist.testing import launch, reports

ROOT = Path(__file__).resolve().parents[2]
EXERCISE_DIR = ROOT / "lessons" / "exercises"
CHECKS = Path(__file__).resolve().parent / "checks.py"
WATCHDOG_S = 5          # PDIST_TIMEOUT inside a graded run: a deadlock is reported after this long
LAUNCH_S = 120          # the whole launch, should the watchdog itself be stuck

# (id, file, points, ranks, what it teaches)
EXERCISES = [
    ("01", "ex01_ring_allreduce.py", 10, 4, "ring all-reduce over isend/irecv"),
    ("02", "ex02_data_parallel.py", 8, 3, "data parallelism by hand"),
    ("03", "ex03_bucketed_ddp.py", 12, 3, "bucketed DDP with overlap"),
    ("04", "ex04_zero1.py", 10, 3, "ZeRO-1"),
    ("05", "ex05_zero3_unit.py", 12, 3, "ZeRO-3 for one unit"),
    ("06", "ex06_tensor_parallel.py", 12, 4, "Column/RowParallelLinear"),
    ("07", "ex07_vocab_parallel_ce.py", 10, 3, "vocab-parallel cross-entropy"),
    ("08", "ex08_one_f_one_b.py", 10, 1, "the 1F1B schedule as data"),
    ("09", "ex09_resharding.py", 8, 1, "resharding reads"),
    ("10", "ex10_find_the_hang.py", 8, 4, "find the hang"),
]
TOTAL = sum(e[2] for e in EXERCISES)


def not_started(path):
    """True when every function of the file that raises NotImplementedError("exercise: ...")
    does nothing else (a docstring may precede it), and there is at least one: nothing
    has been written yet. A file with some functions written is launched, and its first
    unwritten function fails its check with "not written yet"."""
    tree = ast.parse(Path(path).read_text())
    todo = 0
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not any(_is_todo(s) for s in ast.walk(node)):
            continue
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                             and isinstance(s.value.value, str))]
        if len(body) != 1 or not _is_todo(body[0]):
            return False
        todo += 1
    return todo > 0


def _is_todo(stmt):
    if not isinstance(stmt, ast.Raise) or stmt.exc is None:
        return False
    exc = stmt.exc
    name = exc.func.id if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) else \
        exc.id if isinstance(exc, ast.Name) else None
    if name != "NotImplementedError":
        return False
    args = exc.args if isinstance(exc, ast.Call) else []
    return bool(args) and isinstance(args[0], ast.Constant) and str(args[0].value).startswith("exercise:")


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
    """{"exercise", "file", "points", "max", "status", "detail", "seconds"} for one exercise."""
    eid, fname, pts, ranks, _ = ex
    res = {"exercise": eid, "file": fname, "max": pts, "points": 0, "ranks": ranks}
    t0 = time.perf_counter()
    if reference:
        source = "reference"
    else:
        path = Path(directory or EXERCISE_DIR) / fname
        if not path.exists():
            return dict(res, status="missing", detail=f"no {path}", seconds=0.0)
        try:
            if not_started(path):
                return dict(res, status="not started", detail="", seconds=round(time.perf_counter() - t0, 2))
        except SyntaxError as e:
            return dict(res, status="failing", detail=f"syntax error line {e.lineno}: {e.msg}", seconds=0.0)
        source = str(path.resolve())
    run = launch(ranks, CHECKS, eid, source, timeout=LAUNCH_S, wrap=False,
                 env={"PDIST_TIMEOUT": WATCHDOG_S, "OMP_NUM_THREADS": 1, "PDIST_FLIGHT_DIR": _tmp()})
    res["seconds"] = round(time.perf_counter() - t0, 2)
    status, detail = verdict(run, ranks)
    res.update(status=status, detail=detail, points=pts if status == "passed" else 0)
    return res


def _tmp():
    import tempfile
    return tempfile.gettempdir()


def verdict(run, ranks):
    """(status, one-line detail) from a graded run's reports."""
    reps = [r for r in reports(run.out) if "exercise" in r]
    done = {r["rank"] for r in reps if r.get("done")}
    fails = [r for r in reps if r.get("ok") is False]
    if not fails and len(done) == ranks and run.rc == 0:
        return "passed", ""
    if fails:
        first = min(fails, key=lambda r: (r["index"], r["rank"]))
        same = [r for r in fails if r["index"] == first["index"]]
        if all(r.get("kind") == "todo" for r in same):
            return "failing", f"{first['check']}: {first['msg']}"
        timeouts = [r for r in same if r.get("kind") == "timeout" and r.get("reason") == "timeout"]
        if timeouts:
            return "failing", f"{first['check']}: " + deadlock_line(timeouts)
        return "failing", f"{first['check']}: {first['msg']}" + (f" (rank {first['rank']})" if ranks > 1 else "")
    if run.timed_out:
        return "failing", f"no result within {LAUNCH_S} s (a rank is stuck outside pdist's collectives?)"
    tail = [ln for ln in run.out.strip().splitlines() if ln.strip()]
    err = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "")
    return "failing", f"crashed (exit {run.rc}): {err.strip()[:200]}"


def deadlock_line(timeouts):
    """'your code deadlocked: ranks 0, 1, 2, 3 all wait in send (0 to 1, ...)' from each
    rank's watchdog headline ('send to rank 1 on group 'world'')."""
    waits = {r["rank"]: r["where"] for r in timeouts}
    ops = {w.split()[0] for w in waits.values()}
    ranks = sorted(waits)
    who = ("rank " + str(ranks[0])) if len(ranks) == 1 else \
        ("rank " + " and rank ".join(map(str, ranks)) if len(ranks) == 2 else "ranks " + ", ".join(map(str, ranks)))
    if len(ops) == 1 and len(ranks) > 1:
        head = f"deadlocked: {who} are {'both' if len(ranks) == 2 else 'all'} in {ops.pop()}"
    else:
        head = f"deadlocked: {who} wait{'s' if len(ranks) == 1 else ''}"
    where = "; ".join(f"{r}: {waits[r].split(' on group')[0]}" for r in ranks)
    return f"{head} ({where}; watchdog after PDIST_TIMEOUT={WATCHDOG_S} s)"


def grade(exercises, directory=None, reference=False, progress=None):
    results = []
    for ex in exercises:
        res = grade_one(ex, directory, reference)
        results.append(res)
        if progress:
            progress(res)
    return results


def table(results):
    w = max(len(r["file"]) for r in results)
    lines = [f"{'exercise':<{w}}  {'points':>7}  {'time':>6}  status"]
    for r in results:
        st = r["status"] + (f": {r['detail']}" if r.get("detail") else "")
        lines.append(f"{r['file']:<{w}}  {r['points']:>3}/{r['max']:<3}  {r['seconds']:>5.1f}s  {st}")
    got, mx = sum(r["points"] for r in results), sum(r["max"] for r in results)
    lines.append(f"{'total':<{w}}  {got:>3}/{mx:<3}")
    return "\n".join(lines)


def grade_class(class_dir, exercises, out_csv=None):
    """Every subfolder of class_dir is a student holding their exercise files: one CSV row each."""
    students = sorted(p for p in Path(class_dir).iterdir() if p.is_dir())
    rows = []
    for s in students:
        res = grade(exercises, directory=s)
        row = {"student": s.name, "total": sum(r["points"] for r in res)}
        for r in res:
            row[r["exercise"]] = r["points"]
            row[r["exercise"] + "_status"] = r["status"] + (f": {r['detail']}" if r.get("detail") else "")
        rows.append((row, res))
    fields = ["student", "total"] + [c for e in exercises for c in (e[0], e[0] + "_status")]
    f = open(out_csv, "w", newline="") if out_csv else sys.stdout
    try:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row, _ in rows:
            w.writerow(row)
    finally:
        if out_csv:
            f.close()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pdist.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("exercises", nargs="*", help="exercise numbers (01..10) or file names; default: all")
    ap.add_argument("--reference", action="store_true", help="grade the library's own answers (full points)")
    ap.add_argument("--dir", help=f"folder holding the exercise files (default {EXERCISE_DIR})")
    ap.add_argument("--json", action="store_true", help="print the scores as JSON")
    ap.add_argument("--class", dest="class_dir", metavar="DIR",
                    help="grade every student subfolder of DIR into one CSV")
    ap.add_argument("--csv", metavar="PATH", help="with --class: write the CSV here (default stdout)")
    args = ap.parse_args(argv)
    exs = select(args.exercises)
    if args.reference:
        from pdist.course.common import NOT_IN_COPY, reference_available
        if not reference_available():
            raise SystemExit(f"pdist.grade: --reference: {NOT_IN_COPY}")
    if args.class_dir:
        if not os.path.isdir(args.class_dir):
            raise SystemExit(f"pdist.grade: --class {args.class_dir}: no such folder")
        grade_class(args.class_dir, exs, args.csv)
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
        print(table(res))
    return 1 if args.reference and any(r["status"] != "passed" for r in res) else 0


if __name__ == "__main__":
    sys.exit(main())
