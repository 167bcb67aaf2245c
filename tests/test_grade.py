"""The course autograder (pdist/course/grade.py): blank stubs are "not started", the library's
own answers get full points, and a typical wrong answer to every exercise is rejected
with its first failing check (tests/fixtures/wrong/, graded in --class mode)."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdist.course import grade

ROOT = Path(__file__).resolve().parent.parent
WRONG = ROOT / "tests" / "fixtures" / "wrong"


def run_grade(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "pdist.grade", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    return p


def test_blank_stubs_are_not_started_and_exit_zero():
    p = run_grade("--json", timeout=60)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["total"] == 0 and res["max"] == 100
    assert [r["status"] for r in res["exercises"]] == ["not started"] * len(grade.EXERCISES)
    assert all(r["seconds"] < 1 for r in res["exercises"])


def test_stub_files_hold_no_solution():
    for _, fname, _, _, _ in grade.EXERCISES:
        path = ROOT / "lessons" / "exercises" / fname
        assert grade.not_started(path), f"{fname} is not a blank stub"
        doc = path.read_text()
        assert "Grade: ``python -m pdist.grade" in doc and "Math" in doc and "Hints" in doc


def test_partly_written_counts_as_started(tmp_path):
    f = tmp_path / "ex.py"
    f.write_text('def a():\n    """doc"""\n    raise NotImplementedError("exercise: a")\n\n\n'
                 'def b():\n    return 1\n')
    assert grade.not_started(f)            # b was never an exercise function
    f.write_text('def a():\n    x = 1\n    raise NotImplementedError("exercise: a")\n')
    assert not grade.not_started(f)


def test_reference_gets_full_points():
    p = run_grade("--reference", "--json")
    res = json.loads(p.stdout)
    bad = [(r["file"], r["status"], r.get("detail")) for r in res["exercises"] if r["status"] != "passed"]
    assert not bad and res["total"] == res["max"] == 100 and p.returncode == 0, bad


# student folder -> (exercise, what its first failing check must say)
WRONG_ANSWERS = {
    "ring_off_by_one": ("01", "sums small and uneven buffers"),
    "ring_deadlock": ("01", "deadlocked: ranks 0, 1, 2, 3 are all in send (0: send to rank 1"),
    "sum_not_avg": ("02", "equals single-process training"),
    "no_1_over_k": ("02", "gradient accumulation (k = 2)"),
    "buckets_forward_order": ("03", "buckets differ from DDP's"),
    "zero1_all_reduce": ("04", "never all-reduces the gradients"),
    "zero3_never_frees": ("05", "failing"),
    "f_backward_identity": ("06", "dL/dX"),
    "ce_local_max": ("07", "the loss of each row"),
    "warmup_off_by_one": ("08", "peak stash per stage [3, 2]"),
    "reshard_touching_boxes": ("09", "reads an empty slice"),
    "hang_kept": ("10", "CollectiveMismatchError"),
}


def test_every_exercise_has_a_wrong_answer_fixture():
    assert {ex for ex, _ in WRONG_ANSWERS.values()} == {e[0] for e in grade.EXERCISES}
    assert {p.name for p in WRONG.iterdir() if p.is_dir()} == set(WRONG_ANSWERS)


def test_class_mode_rejects_each_wrong_answer(tmp_path):
    out = tmp_path / "class.csv"
    p = run_grade("--class", str(WRONG), "--csv", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == set(WRONG_ANSWERS)
    for student, (ex, says) in WRONG_ANSWERS.items():
        r = rows[student]
        assert r["total"] == "0" and r[ex] == "0", (student, r)
        assert r[ex + "_status"].startswith("failing") and says in r[ex + "_status"], (student, r[ex + "_status"])
        others = [k for k in r if k.endswith("_status") and k != ex + "_status"]
        assert all(r[k].startswith("missing") for k in others)


def test_dir_option_and_selection(tmp_path):
    (tmp_path / "ex08_one_f_one_b.py").write_text((WRONG / "warmup_off_by_one" / "ex08_one_f_one_b.py").read_text())
    p = run_grade("08", "--dir", str(tmp_path), "--json")
    res = json.loads(p.stdout)
    assert [r["exercise"] for r in res["exercises"]] == ["08"]
    assert res["exercises"][0]["status"] == "failing" and "warm-up" in res["exercises"][0]["detail"]
    with pytest.raises(SystemExit):
        grade.select(["99"])


def test_deadlock_line_names_each_rank():
    line = grade.deadlock_line([{"rank": 0, "where": "send to rank 1 on group 'world'"},
                                {"rank": 1, "where": "send to rank 0 on group 'world'"}])
    assert line.startswith("deadlocked: rank 0 and rank 1 are both in send")


def test_lesson05_png_without_matplotlib_fails_at_once():
    pytest.importorskip("numpy")
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    p = subprocess.run([sys.executable, "lessons/05_pipeline_parallel.py", "--png", "x.png"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "pip install 'pdist[plots]'" in p.stderr


def test_shared_core_warning_once_on_rank_0(tmp_path):
    from pdist.testing import launch
    script = tmp_path / "w.py"
    script.write_text("from pdist import comm\nfrom pdist.course import lesson\nimport os\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
                      "from pdist.testing import report\nw = comm.init()\nreport(warned=lesson.warn_shared_cores(w))\n")
    run = launch(2, script, timeout=60)
    assert run.rc == 0, run.out
    from pdist.testing import reports
    assert run.out.count("shared-core timings") == 1 and [r["warned"] for r in reports(run.out)] == [True, True]
