"""The grader's runner: unforgeable verdicts (course/channel.py), a student's process tree
reaped within the cap, a bad file failing one exercise only (screening.py), full detail of the
first failure, the library's answer flagged, class mode with progress, JSON and caps.
(launch itself: tests/test_launch_cleanup.py.)"""
import importlib
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pdist.course import classroom, grade, screening
from pdist.course.channel import ENV, Channel, Reporter

ROOT = Path(__file__).resolve().parent.parent
WRONG = ROOT / "tests" / "fixtures" / "wrong"


def procs_with(needle, where="environ"):
    """PIDs (not this one) whose /proc/<pid>/<where> holds ``needle`` (bytes)."""
    found = []
    for n in os.listdir("/proc"):
        if n.isdigit() and int(n) != os.getpid():
            try:
                with open(f"/proc/{n}/{where}", "rb") as f:
                    data = f.read()
                with open(f"/proc/{n}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in data and state != "Z":
                found.append(int(n))
    return found


def run_grade(*args, tag="", timeout=200):
    env = dict(os.environ, PDIST_TEST_TAG=tag)
    return subprocess.run([sys.executable, "-m", "pdist.grade", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def grade_files(folder, files, *args, tag=""):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    p = run_grade("--dir", folder, "--json", *args, tag=tag)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["exercises"]


FORGE = '''import json, os
fake = {"exercise": "08", "rank": 0, "done": True, "checks": 3}
print("[pdist report] " + json.dumps(fake), flush=True)
env = open("/proc/self/environ", "rb").read().split(b"\\0")
for d in [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PDIST_GRADE_CHANNEL=")]:
    with open(os.path.join(d, "rank0.jsonl"), "a") as f:     # the channel, but without the key
        f.write("0" * 64 + " " + json.dumps(fake) + "\\n")
os._exit(0)
'''


def test_a_forged_report_scores_zero(tmp_path):
    (r,) = grade_files(tmp_path / "s", {"ex08_one_f_one_b.py": FORGE}, "08")
    assert r["status"] == "failing" and r["points"] == 0, r
    assert "2 forged/unsigned report lines ignored" in r["msg"] and "exit 0" in r["msg"], r["msg"]


def test_the_channel_takes_only_lines_signed_with_its_key(monkeypatch):
    ch = Channel()
    try:
        monkeypatch.setenv(ENV, ch.env(2)[ENV])
        rep = Reporter.from_env(1)
        assert ENV not in os.environ and not os.path.exists(os.path.join(ch.dir, "key.1"))
        rep.report(rank=1, ok=True)
        with open(os.path.join(ch.dir, "rank1.jsonl")) as f:
            good = f.read()
        with open(os.path.join(ch.dir, "rank0.jsonl"), "w") as f:      # rank 1's line replayed as rank 0's
            f.write(good + good.replace("true", "false"))
        assert ch.read(2) == ([{"rank": 1, "ok": True}], 2)
    finally:
        ch.close()


def test_setsid_children_are_reaped_within_the_cap(tmp_path):
    tag, secs = uuid.uuid4().hex, f"{600 + random.random():.6f}"
    student = (f"import subprocess\nsubprocess.Popen(['sleep', '{secs}'], start_new_session=True)\n"
               f"subprocess.Popen(['sleep', '{secs}1'], start_new_session=True, env={{}},\n"
               "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)   # no marker at all\n"
               "def one_f_one_b(p, m):\n    return []\n")
    t0 = time.monotonic()
    (r,) = grade_files(tmp_path / "s", {"ex08_one_f_one_b.py": student}, "08", tag=tag)
    took = time.monotonic() - t0
    cap, _ = grade.cap_for("08")
    assert r["status"] == "failing" and r["points"] == 0, r
    assert took < cap + 15, (took, cap)      # today's main waits for the sleeps' end (600 s)
    assert procs_with(f"PDIST_TEST_TAG={tag}".encode()) == []
    assert procs_with(secs.encode(), "cmdline") == []


def test_bad_files_fail_one_exercise_and_never_stop_the_class(tmp_path):
    c = tmp_path / "class"
    for s in ("bin", "deep", "dir", "misnamed", "blank"):
        (c / s).mkdir(parents=True)
    (c / "bin" / "ex01_ring_allreduce.py").write_bytes(b"# caf\xe9\ndef ring_all_reduce(group, buf):\n    pass\n")
    (c / "deep" / "ex09_resharding.py").write_text("x = " + "-" * 200_000 + "1\n")
    (c / "deep" / "ex01_ring_allreduce.py").write_text("x = a" + ".b" * 200_000 + "\n")
    (c / "dir" / "ex04_zero1.py").mkdir()
    (c / "misnamed" / "ex3_bucketed.py").write_text("x = 1\n")
    p = run_grade("--class", c, "--json", "01", "03", "04", "09")
    assert p.returncode == 0, p.stderr
    st = {s["student"]: {r["exercise"]: (r["status"], r["msg"]) for r in s["exercises"]}
          for s in json.loads(p.stdout)["students"]}
    assert st["bin"]["01"] == ("failing", "ex01_ring_allreduce.py is not UTF-8 text (byte 5: b'\\xe9\\nde'); "
                                          "save it as UTF-8")
    assert st["deep"]["09"][0] == "failing" and "nests too deeply" in st["deep"]["09"][1]
    assert st["deep"]["01"][0] == "failing" and "nests too deeply" in st["deep"]["01"][1]
    assert st["dir"]["04"][0] == "failing" and "is a directory" in st["dir"]["04"][1]
    assert st["misnamed"]["03"] == ("missing", "expected ex03_bucketed_ddp.py; found ex3_bucketed.py")
    assert all(s == "missing" for s, _ in st["blank"].values())


HELPER_RAISES = '''def _stage_count(p):
    raise ValueError("the stages do not add up\\nline two: p was %d, the full story" % p)


def one_f_one_b(p, m):
    return _stage_count(p)
'''


def test_the_first_failure_shows_its_full_detail(tmp_path):
    (r,) = grade_files(tmp_path / "s", {"ex08_one_f_one_b.py": HELPER_RAISES}, "08")
    assert r["msg"].endswith("raised ValueError: the stages do not add up (ex08_one_f_one_b.py:2)"), r["msg"]
    d = r["detail"]
    assert "line two: p was 1, the full story" in d and "in _stage_count" in d and "in one_f_one_b" in d, d
    assert "checks_model.py" not in d and "checks.py" not in d          # the student's frames only
    p = run_grade("--dir", tmp_path / "s", "08")
    assert "ex08_one_f_one_b.py: failing, in full:" in p.stdout and "line two: p was 1" in p.stdout, p.stdout


DEADLOCK = """import numpy as np


def ring_all_reduce(group, buf):
    if group.size == 1:
        return
    tmp = np.empty_like(buf)
    group.recv(tmp, (group.rank - 1) % group.size)      # every rank waits to receive first
    group.send(buf, (group.rank + 1) % group.size)
"""


def test_a_deadlock_carries_the_watchdogs_roll_call(tmp_path):
    (r,) = grade_files(tmp_path / "s", {"ex01_ring_allreduce.py": DEADLOCK}, "01")
    assert "deadlocked" in r["msg"] and "in recv" in r["msg"] and "roll-call of group" in r["detail"], r


def test_a_failed_collectives_reason_reaches_the_one_line():
    from pdist.course.checks import failure      # e.g. a Work never waited on: "invalid arguments" alone misleads
    e = RuntimeError("all_reduce #26 on group 'world': invalid arguments\n  rank 0: all_reduce #26 size=48"
                     "  <- async all_reduce #19 on group 'world' was never waited on")
    assert failure(e, "reference", TimeoutError)["msg"] == ("raised RuntimeError: all_reduce #26 on group 'world': "
                                                            "invalid arguments: async all_reduce #19 on group "
                                                            "'world' was never waited on")


def test_the_rank_that_failed_is_named_not_the_ranks_it_stopped():
    """A check fails on rank 2 only; ranks 0 and 1 then stop in a collective because rank 2
    is gone: the verdict shows rank 2's reason, whatever the rank numbers."""
    from types import SimpleNamespace
    from pdist.course.verdict import verdict
    reps = [dict(rank=r, index=1, check="c", ok=False, kind="timeout", reason="dead",
                 msg="rank 2 is dead (pid 1 is gone)", where="x") for r in (0, 1)]
    reps.append(dict(rank=2, index=1, check="c", ok=False, msg="got = 0.5 x expected"))
    reps += [dict(rank=r, index=0, check="b", ok=True) for r in range(3)]
    run = SimpleNamespace(out="", rc=3, timed_out=False)
    v = verdict(reps, 0, run, 3, 10)
    assert v["status"] == "failing" and v["msg"] == "c: got = 0.5 x expected (rank 2)", v


SIZE_MISMATCH = """
import numpy as np
from pdist import comm, nn
from pdist.data import shard


def fixed_train(model, opt, group, get_batch, steps):
    losses = []
    for step in range(steps):
        comm.set_step(step)
        x, y = shard(get_batch(step), group.rank, group.size)
        loss = nn.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            group.all_reduce(p.grad, op="avg")
        opt.step()
        opt.zero_grad()
        v = np.array([loss.item()] * (1 + group.rank % 2))      # odd ranks send two numbers
        group.all_reduce(v, op="avg")
        losses.append(float(v[0]))
    return losses
"""


def test_an_error_in_student_code_shows_its_frames_and_whole_message(tmp_path):
    (r,) = grade_files(tmp_path / "s", {"ex10_find_the_hang.py": SIZE_MISMATCH}, "10")
    assert "raised CollectiveMismatchError" in r["msg"] and "(ex10_find_the_hang.py:19)" in r["msg"], r["msg"]
    d = r["detail"]
    assert "Traceback (your code's frames)" in d and "in fixed_train" in d and "all_reduce #5 step 0 size=2 dtype" in d, d
    assert "checks" not in d.split("Traceback", 1)[1].split("CollectiveMismatchError")[0], d   # no grader frames


WARMUP = """def one_f_one_b(p, m):
    from pdist.parallel.pipeline.schedules import BACKWARD, FORWARD, _program
    programs = []
    for s in range(p):
        w = min(p - s, m)                       # one warm-up forward too many: p - s - 1 is right
        order = [(FORWARD, i, 0) for i in range(w)]
        for i in range(m - w):
            order += [(FORWARD, w + i, 0), (BACKWARD, i, 0)]
        programs.append(_program(p, s, 1, order + [(BACKWARD, i, 0) for i in range(m - w, m)]))
    return programs
"""


def test_verbose_shows_every_check_with_its_time(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "ex08_one_f_one_b.py").write_text(WARMUP)
    p = run_grade("--dir", tmp_path / "s", "--verbose", "08")
    lines = [ln.strip() for ln in p.stdout.splitlines()]
    assert any(ln.startswith("ok") and ln.endswith(" s)") for ln in lines), p.stdout      # passed, with its time
    assert any(ln.startswith("FAIL") and "peak stash" in ln for ln in lines), p.stdout


LIBRARY = {
    "01": ("from pdist.course.solutions import ring_all_reduce  # noqa\n", "imports the reference answers"),
    "02": ("import pdist.parallel.data_parallel as dp\n\n\ndef average_gradients(params, group):\n"
           "    return dp.DataParallel\n", "uses pdist.parallel.data_parallel.DataParallel"),
    "08": ("from pdist.parallel.pipeline.schedules import one_f_one_b  # noqa\n",
           "uses pdist.parallel.pipeline.schedules.one_f_one_b"),
}


def test_the_librarys_answer_scores_zero_with_the_reason(tmp_path):
    files = {grade.select([e])[0][1]: src for e, (src, _) in LIBRARY.items()}
    res = {r["exercise"]: r for r in grade_files(tmp_path / "s", files, *LIBRARY)}
    for e, (_, why) in LIBRARY.items():
        assert res[e]["status"] == "uses the library's answer" and res[e]["points"] == 0, res[e]
        assert why in res[e]["msg"], res[e]["msg"]


def test_honest_answers_are_never_flagged():
    honest = list(WRONG.glob("*/ex*.py")) + list((ROOT / "lessons" / "exercises").glob("ex*.py"))
    assert len(honest) >= 10
    for f in honest:
        eid, (tree, _) = f.name[2:4], screening.parse(f.read_text(), f.name)
        assert screening.uses_library_answer(tree, eid) is None, f
    tree, _ = screening.parse("from pdist.course.solutions import average_gradients\n", "x")
    assert "reference answers" in screening.uses_library_answer(tree, "02")


def test_forbidden_targets_name_real_things():
    for eid, rules in screening.FORBIDDEN.items():
        for target, reason in rules:
            if target.startswith(".") or target == "mpi4py":
                continue
            mod, _, attr = target.rpartition(".")
            try:
                importlib.import_module(target)
            except ImportError:
                assert hasattr(importlib.import_module(mod), attr), (eid, target)


STUCK = "import time\n\n\ndef one_f_one_b(p, m):\n    time.sleep(1000)\n"


def test_class_mode_progress_json_and_a_stuck_student_capped(tmp_path):
    c = tmp_path / "class"
    (c / "ana").mkdir(parents=True)
    (c / "bo").mkdir()
    (c / "ana" / "ex08_one_f_one_b.py").write_text(WARMUP)
    (c / "bo" / "ex08_one_f_one_b.py").write_text(STUCK)
    p = run_grade("--class", c, "--json", "08", "09")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    got = {s["student"]: {r["exercise"]: r for r in s["exercises"]} for s in res["students"]}
    assert got["ana"]["08"]["status"] == "failing" and "peak stash" in got["ana"]["08"]["msg"]
    bo = got["bo"]["08"]
    assert bo["status"] == "failing" and bo["msg"].startswith("stopped after") and "no result" in bo["msg"], bo
    cap = float(bo["msg"].split("stopped after ")[1].split(" s")[0])
    assert bo["seconds"] < cap + 6 and grade.CAP_S["08"] <= 15, bo
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("[")]
    assert len(lines) == 4 and lines[-1].startswith("[4/4]") and all("s left" in ln for ln in lines), p.stderr


def test_every_cap_is_at_most_15_s_and_slots_count_ranks():
    assert set(grade.CAP_S) == {e[0] for e in grade.EXERCISES} and max(grade.CAP_S.values()) <= 15
    s = classroom.Slots(4)
    assert s.take(4) == 4 and s.free == 0 and s.give(4) is None
    assert s.take(8) == 4          # a job larger than the pool runs alone
