"""The course autograder (pdist/course/grade.py): blank stubs are "not started", the library's
own answers get full points, and every wrong answer in tests/fixtures/wrong/ (plausible
student mistakes, several per exercise) is rejected by the check that names its mistake."""
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


def blank_stubs(tmp_path):
    """The blank exercise files (pdist.course.handout.blank_stub: the working file while it is
    blank, else the committed one), written to tmp_path: a student's answers in
    lessons/exercises/ are never what these tests read."""
    from pdist.course.handout import blank_stub
    out = tmp_path / "blank"
    out.mkdir()
    for _, fname, _, _, _ in grade.EXERCISES:
        text = blank_stub(fname, ROOT)
        if text is None:
            pytest.skip(f"lessons/exercises/{fname} holds an answer and no git history has its blank stub "
                        f"(a copy without .git); nothing blank to check")
        (out / fname).write_text(text)
    return out


def test_blank_stubs_are_not_started_and_exit_zero(tmp_path):
    p = run_grade("--json", "--dir", str(blank_stubs(tmp_path)), timeout=60)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["total"] == 0 and res["max"] == 100
    assert [r["status"] for r in res["exercises"]] == ["not started"] * len(grade.EXERCISES)
    assert all(r["seconds"] < 1 for r in res["exercises"])


def test_stub_files_hold_no_solution(tmp_path):
    blank = blank_stubs(tmp_path)
    for _, fname, _, _, _ in grade.EXERCISES:
        path = blank / fname
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


STUDENT_COPY = not (ROOT / "pdist" / "course" / "solutions.py").is_file()
in_instructor_copy = pytest.mark.skipif(STUDENT_COPY, reason="a student copy (make handout): the reference answers "
                                        "and the wrong-answer fixtures are not in it")


@in_instructor_copy
def test_reference_gets_full_points():
    p = run_grade("--reference", "--json")
    res = json.loads(p.stdout)
    bad = [(r["file"], r["status"], r.get("detail")) for r in res["exercises"] if r["status"] != "passed"]
    assert not bad and res["total"] == res["max"] == 100 and p.returncode == 0, bad


# student folder -> (exercise, what its first failing check must say); each folder holds one
# exercise file, a plausible mistake (its docstring says which), self-contained (it never imports
# the reference answers, which the grader rejects on sight)
WRONG_ANSWERS = {
    "ring_off_by_one": ("01", "n = 2: the sum of a 8-element buffer differs"),
    "ring_deadlock": ("01", "deadlocked: ranks 0, 1, 2, 3 are all in send (0: send to rank 1"),
    "ring_n_hardcoded": ("01", "is not a rank of group 'first2' (size 2)"),
    "ring_allgather_adds": ("01", "n = 2: the sum of a 8-element buffer differs"),
    "ring_floor_chunks": ("01", "the sum of a 1-element buffer differs"),
    "ring_rs_overwrites": ("01", "n = 2: the sum of a 8-element buffer differs"),
    "sum_not_avg": ("02", "after average_gradients, transformer.wte.weight.grad"),
    "avg_by_two": ("02", "got = 0.5 x expected"),
    "skip_unused_grad": ("02", "gradient is None on this rank must still get the average"),
    "no_contiguous": ("02", "an F-ordered gradient works"),
    "no_1_over_k": ("02", "k = 2 micro-batches of the whole batch"),
    "accum_returns_sum": ("02", "k = 2: the returned loss"),
    "buckets_forward_order": ("03", "cap 8192 bytes: buckets differ from DDP's"),
    "buckets_cap_ge": ("03", "buckets differ from DDP's"),
    "buckets_empty_first": ("03", "yours of [0, "),
    "ddp_sum_not_avg": ("03", "after finish_grad_sync, transformer.wte.weight.grad"),
    "ddp_next_not_advanced": ("03", "left ddp.next at 0"),
    "ddp_no_wait": ("03", "never waited on"),
    "ddp_issue_when_complete": ("03", "all-reduced in the order [1, 0"),
    "ddp_no_reset": ("03", "reset for the next step"),
    "zero1_all_reduce": ("04", "never all-reduces the gradients"),
    "zero1_sum": ("04", "got = 3 x expected"),
    "zero1_floor_chunk": ("04", "reduce_scatter"),
    "zero1_no_all_gather": ("04", "after 3 steps the parameters"),
    "zero1_local_grad": ("04", "step 0: shard.grad"),
    "zero3_never_frees": ("05", "after free_unit every parameter must be empty"),
    "zero3_free_keeps_full": ("05", "after free_unit every parameter must be empty"),
    "zero3_copies": ("05", "a view of unit.full, not a copy"),
    "zero3_sum": ("05", "got = 3 x expected"),
    "zero3_keeps_grad": ("05", "drop the full gradient"),
    "zero3_unpadded": ("05", "all_gather"),
    "f_backward_identity": ("06", "f's backward (the sum of the ranks' gradients)"),
    "f_backward_in_place": ("06", "f's backward changed the gradient array it was given"),
    "g_forward_in_place": ("06", "g's forward changed its input array"),
    "g_backward_all_reduce": ("06", "dL/dX"),
    "row_bias_before_sum": ("06", "the MLP's output Y"),
    "row_bias_halved": ("06", "the row layer's bias gradient"),
    "ce_local_max": ("07", "random logits: the loss of each row"),
    "ce_owner_le": ("07", "targets on every slice boundary"),
    "ce_owner_gt0": ("07", "targets on slice boundaries: the loss of each row"),
    "ce_no_shift": ("07", "large logits: the loss of each row"),
    "ce_grad_rows_ignored": ("07", "dL/dlogits on this rank's vocabulary slice"),
    "ce_local_softmax": ("07", "dL/dlogits on this rank's vocabulary slice"),
    "warmup_off_by_one": ("08", "peak stash per stage [3, 2]"),
    "warmup_no_min": ("08", "p=3, m=1: the schedule checker says"),
    "gpipe_not_1f1b": ("08", "peak stash per stage [4, 4]"),
    "steady_backward_first": ("08", "runs before its forward"),
    "drain_reversed": ("08", "simulated bubble"),
    "reshard_touching_boxes": ("09", "reads an empty slice"),
    "reshard_absolute_src": ("09", "does not give the target box"),
    "reshard_axis0_only": ("09", "reads an empty slice of saved box"),
    "reshard_src_dst_swapped": ("09", "does not give the target box"),
    "hang_kept": ("10", "CollectiveMismatchError"),
    "hang_local_loss": ("10", "n = 2: the loss per step"),
    "hang_sum_grads": ("10", "n = 2: the loss per step"),
    "hang_sum_loss": ("10", "got = 2 x expected"),
    "hang_every_other_step": ("10", "n = 2: the loss per step"),
    "osm_no_rescale": ("11", "the larger scores second, blocks in the order A, B: y differs"),
    "osm_lse_is_max": ("11", "one full block, blocks in the order A: the log-sum-exp lse differs"),
    "osm_no_diag_mask": ("11", "the diagonal block alone (causal: key j hidden from query i when j > i), "
                               "blocks in the order diagonal: y differs"),
    "osm_mask_hides_self": ("11", "the diagonal block alone (causal: key j hidden from query i when j > i), "
                                  "blocks in the order diagonal: y is not finite"),
    "osm_new_block_max": ("11", "the block near 1000 first, blocks in the order A, B: y is not finite"),
    "osm_no_max": ("11", "the block near 1000 last, blocks in the order B, A: y is not finite"),
    "zb_w_before_b": ("13", "runs before its B"),
    "zb_b_waits_on_w": ("13", "runs between a B and its SEND_GRAD"),
    "zb_warmup_too_few": ("13", "too few warm-up steps"),
    "zb_w_right_after_b": ("13", "simulated bubble 0.1429"),
    "zb_whole_backward": ("13", "runs a whole BACKWARD"),
    "zb_all_w_at_end": ("13", "peak stash per stage [4, 4]"),
    "moe_drop_last_expert": ("12", "sort_by_expert: counts has shape (3,) for n_expert = 4"),
    "moe_backward_same_counts": ("12", "AllToAllV's backward: CollectiveMismatchError"),
    "moe_counts_not_exchanged": ("12", "the row count of each local expert (per_expert) differs"),
    "moe_combine_wrong_order": ("12", "combine: row i of the result is the output for xs's row i differs"),
    "moe_no_gate_weight": ("12", "moe_forward: the layer's output y differs"),
    "moe_avg_over_ep": ("12", "expert parameter 0's gradient differs from pdist's (max relative error 1; got = 2 x"),
}


@in_instructor_copy
def test_every_exercise_has_wrong_answer_fixtures():
    assert len(WRONG_ANSWERS) >= 30
    assert {ex for ex, _ in WRONG_ANSWERS.values()} == {e[0] for e in grade.EXERCISES}
    assert {p.name for p in WRONG.iterdir() if p.is_dir()} == set(WRONG_ANSWERS)
    files = {e[0]: e[1] for e in grade.EXERCISES}
    for student, (ex, _) in WRONG_ANSWERS.items():
        held = sorted(f.name for f in (WRONG / student).iterdir() if f.name != "__pycache__")   # (Python's cache)
        assert held == [files[ex]], (student, held)             # one exercise per folder: class mode grades it fast
        text = (WRONG / student / files[ex]).read_text()
        assert text.startswith('"""Wrong: ') and "solutions" not in text, student


@in_instructor_copy
@pytest.mark.slow
@pytest.mark.parametrize("eid", [e[0] for e in grade.EXERCISES])
def test_each_wrong_answer_is_rejected_naming_its_mistake(eid):
    """Every wrong answer of one exercise, graded in as few jobs as they allow
    (pdist/course/checks_batch.py: the same checks and verdict as ``grade_one``, a file
    after another only while every file ends cleanly on every rank); each must fail with 0
    points and its own reason. Class mode and --dir (below) grade through ``grade_one``."""
    from pdist.course.checks_batch import grade_batch
    students = sorted(s for s, (ex_id, _) in WRONG_ANSWERS.items() if ex_id == eid)
    ex = next(e for e in grade.EXERCISES if e[0] == eid)
    missed = []
    for student, r in zip(students, grade_batch(ex, [WRONG / s for s in students])):
        text = " ".join(str(v) for v in r.values())
        if not (r["status"] == "failing" and r["points"] == 0 and WRONG_ANSWERS[student][1] in text):
            missed.append((student, WRONG_ANSWERS[student][1], r["status"], r["msg"]))
    assert not missed, "\n".join(f"{s}: want {want!r}; got {st}: {msg}" for s, want, st, msg in missed)


@in_instructor_copy
def test_class_mode_rejects_wrong_answers(tmp_path):
    """Class mode on three students (the full set runs one by one above): one CSV row each."""
    students = ["warmup_off_by_one", "reshard_touching_boxes", "ring_off_by_one"]
    for s in students:
        (tmp_path / "class" / s).mkdir(parents=True)
        for f in (WRONG / s).iterdir():
            if f.is_file():                      # (not a __pycache__ that grading it may leave)
                (tmp_path / "class" / s / f.name).write_text(f.read_text())
    out = tmp_path / "class.csv"
    p = run_grade("--class", str(tmp_path / "class"), "--csv", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == set(students)
    for student in students:
        ex, says = WRONG_ANSWERS[student]
        r = rows[student]
        assert r["total"] == "0" and r[ex] == "0", (student, r)
        assert r[ex + "_status"].startswith("failing") and says in r[ex + "_status"], (student, r[ex + "_status"])
        others = [k for k in r if k.endswith("_status") and k != ex + "_status"]
        assert all(r[k].startswith("missing") for k in others)


@in_instructor_copy
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
