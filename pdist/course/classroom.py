"""Class mode: ``python -m pdist.grade --class DIR [--json] [--csv OUT.csv]``.

Every subfolder of DIR is one student holding their exercise files. Exercises are graded
in parallel: a pool of ``max(cores, largest job)`` slots (cores from
``os.sched_getaffinity``), where a job of n ranks takes n slots, so the machine is never
asked for more ranks than it has cores (a job larger than the pool runs alone). Each
finished exercise prints one progress line on stderr with the time spent and an estimate
of the time left. One student's bad file, or a grader error on it, is that student's
status for that exercise; the class always finishes. Output: one CSV row per student
(``student, total, <id>, <id>_status`` ...) on stdout or in ``--csv``, or with ``--json``
``{"max", "students": [{"student", "total", "exercises": [result, ...]}]}`` (each result
as ``grade_one`` returns it, with the full detail).
"""
import csv
import io
import json
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from pdist import procs
from pdist.course.summary import write_text_atomic


class Slots:
    """A counting semaphore taken n at a time (n clamped to the pool)."""

    def __init__(self, total):
        self.total, self.free, self.cond = total, total, threading.Condition()

    def take(self, n):
        n = min(n, self.total)
        with self.cond:
            self.cond.wait_for(lambda: self.free >= n)
            self.free -= n
        return n

    def give(self, n):
        with self.cond:
            self.free += n
            self.cond.notify_all()


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def safe_grade_one(grade_one, ex, folder):
    """``grade_one(ex, directory=folder)``, with any grader error turned into this exercise's status."""
    try:
        return grade_one(ex, directory=folder)
    except Exception as e:      # one student's file must never stop the class
        eid, fname, pts, ranks, _ = ex
        msg = f"the grader could not grade this file ({type(e).__name__}: {e}); tell your instructor"
        return {"exercise": eid, "file": fname, "max": pts, "points": 0, "ranks": ranks, "status": "grader error",
                "msg": msg, "detail": msg + "\n" + traceback.format_exc(), "checks": [], "seconds": 0.0}


class Progress:
    """One line per finished exercise on ``stream``: count, student, file, status, time, ETA."""

    def __init__(self, total, stream=sys.stderr):
        self.total, self.stream = total, stream
        self.done, self.t0, self.lock = 0, time.perf_counter(), threading.Lock()

    def __call__(self, student, res):
        with self.lock:
            self.done += 1
            spent = time.perf_counter() - self.t0
            left = self.total - self.done
            eta = spent / self.done * left       # the throughput seen so far, parallelism included
            st = res["status"] + (f": {res['msg'][:80]}" if res.get("msg") else "")
            print(f"[{self.done}/{self.total}] {student} {res['file']}: {st} ({res['seconds']:.1f} s); "
                  f"{spent:.0f} s so far, about {eta:.0f} s left", file=self.stream, flush=True)


def grade_class(class_dir, exercises, grade_one, out_csv=None, as_json=False, slots=None, stream=sys.stdout):
    """Grade every student subfolder of ``class_dir`` with ``grade_one`` (pdist.course.grade's);
    returns [(row, results)] per student."""
    students = sorted(p for p in Path(class_dir).iterdir() if p.is_dir() and not p.name.startswith("."))
    tasks = [(s, ex) for s in students for ex in exercises]
    progress = Progress(len(tasks))
    results = {}

    def one(task):
        s, ex = task
        res = results[(s.name, ex[0])] = safe_grade_one(grade_one, ex, s)
        progress(s.name, res)

    pooled(tasks, lambda t: t[1][3], one, slots)
    rows = []
    for s in students:
        res = [results[(s.name, e[0])] for e in exercises]
        row = {"student": s.name, "total": sum(r["points"] for r in res)}
        for r in res:
            row[r["exercise"]] = r["points"]
            row[r["exercise"] + "_status"] = r["status"] + (f": {r['msg']}" if r.get("msg") else "")
        rows.append((row, res))
    if as_json:
        stream.write(json.dumps({"max": sum(e[2] for e in exercises), "students": [
            {"student": row["student"], "total": row["total"], "exercises": res} for row, res in rows]}, indent=1)
            + "\n")
    if out_csv or not as_json:
        write_csv(rows, exercises, out_csv, stream)
    return rows


def pooled(tasks, ranks_of, run, slots=None):
    """``run(task)`` for every task, in parallel on a pool of ``slots`` (default
    ``max(cores, largest job)``) where a task takes ``ranks_of(task)`` of them."""
    size = slots or max([cores()] + [ranks_of(t) for t in tasks])
    pool, stop = Slots(size), threading.Event()

    def work(task):
        n = pool.take(ranks_of(task))
        try:
            if not stop.is_set():
                run(task)
        finally:
            pool.give(n)

    run_all(work, tasks, size, stop)


def run_all(work, tasks, workers, stop):
    """``work(task)`` for every task on ``workers`` threads. Interrupted (Ctrl-C), it
    starts no new task, kills the running launches and re-raises."""
    pool = ThreadPoolExecutor(max_workers=workers, initializer=procs.signals_to_main_thread)
    try:
        for f in [pool.submit(work, t) for t in tasks]:
            while not f.done():                 # short waits: Ctrl-C is handled within 0.2 s
                wait([f], timeout=0.2)
            f.result()
    except BaseException:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        procs.kill_all_live(stop_new=True)     # and a launch a thread is starting right now
        raise
    pool.shutdown()


def write_csv(rows, exercises, out_csv, stream):
    """The CSV on ``stream``, or written atomically to ``out_csv``."""
    fields = ["student", "total"] + [c for e in exercises for c in (e[0], e[0] + "_status")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for row, _ in rows:
        w.writerow(row)
    if out_csv:
        write_text_atomic(out_csv, buf.getvalue())
    else:
        stream.write(buf.getvalue())
