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


def test_a_deadlock_carries_the_watchdogs_roll_call():
    (r,) = json.loads(run_grade("--dir", WRONG / "ring_deadlock", "--json", "01").stdout)["exercises"]
    assert "deadlocked" in r["msg"] and "roll-call of group" in r["detail"], r


NO_WAIT = """def make_buckets(params, cap_bytes):
    out, cur, size = [], [], 0
    for p in reversed(list(params)):
        nb = p.data.nbytes
        if cur and size + nb > cap_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += nb
    if cur:
        out.append(cur)
    return out
def on_grad_ready(ddp, p):
    b = ddp.bucket_of[id(p)]
    b.ready.add(id(p))
    while ddp.next < len(ddp.buckets) and len(ddp.buckets[ddp.next].ready) == len(ddp.buckets[ddp.next].params):
        nb = ddp.buckets[ddp.next]
        nb.work = ddp.group.all_reduce(nb.buffer, op="avg", async_op=True)
        ddp.next += 1
def finish_grad_sync(ddp):
    for b in ddp.buckets[ddp.next:]:
        b.work = ddp.group.all_reduce(b.buffer, op="avg", async_op=True)
    for b in ddp.buckets:
        b.work = None
        b.ready.clear()
    ddp.next = 0
"""   # finish_grad_sync never waits


def test_a_never_waited_work_is_named_in_the_one_line(tmp_path):
    (r,) = grade_files(tmp_path / "s", {"ex03_bucketed_ddp.py": NO_WAIT}, "03")
    assert "never waited on" in r["msg"], r["msg"]          # was: "invalid arguments" only


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


def test_verbose_shows_every_check_with_its_time():
    p = run_grade("--reference", "--verbose", "08")
    assert p.returncode == 0, p.stderr
    for name in ("the schedule checker accepts it", "simulated bubble", "peak stash"):
        assert any(ln.strip().startswith("ok") and name in ln and " s)" in ln for ln in p.stdout.splitlines()), \
            p.stdout


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
        fixture = screening.FIXTURES in f.resolve().parents        # may import the answers it does not break
        assert screening.uses_library_answer(tree, eid, allow_solutions=fixture) is None, f
    tree, _ = screening.parse("from pdist.course.solutions import average_gradients\n", "x")
    assert screening.uses_library_answer(tree, "02", allow_solutions=True) is None
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
    (c / "ana" / "ex08_one_f_one_b.py").write_text((WRONG / "warmup_off_by_one" / "ex08_one_f_one_b.py").read_text())
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
