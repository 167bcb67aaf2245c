"""``save`` owns only what it wrote (issue 30, items 1, 2 and 7; pdist/checkpoint/writer.py,
owner.py, runs.py). Each test is one defect found on the earlier ``save``:

* a parent passed by mistake, or a regular file at the path, is refused (its files kept),
  with the same CheckpointError on every rank, before any rank writes;
* ``keep=`` is a positive int and prunes only this run's checkpoints, never the one just
  written: next to an older run's step-000900, ``keep=1`` keeps the new step-000100 and
  ``latest()`` returns it; a resumed model continues its checkpoint's run;
* ``extra=`` with a NaN is refused before anything is written;
* a write that fails (a file size limit on one rank) fails on every rank, leaves nothing,
  and the next save succeeds; a save killed mid-write leaves pdist-named leftovers that
  the next save in that parent removes (its stale lock is reclaimed);
* a SIGKILL between the two renames of an overwrite leaves ``latest()`` a complete checkpoint;
* two writers to one path: one clear error, no temporary directories left.

Multi-rank cases run at 2 ranks under real mpiexec (tests/workers/ckpt_save_cases.py); the
single-process ones in subprocesses that are killed on purpose (tests/workers/ckpt_save_one.py)."""
import json
import os
import socket
import threading
import time

import pytest

from pdist import checkpoint
from pdist.checkpoint import owner
from pdist.checkpoint.format import CheckpointError, verify
from pdist.testing import launch, mpirun, reports

ONE = "tests/workers/ckpt_save_one.py"


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("save")
    os.makedirs(root / "parent" / "step-000100")
    (root / "parent" / "step-000100" / "model.bin").write_bytes(b"the user's weights")
    (root / "parent" / "notes.txt").write_text("my notes\n")
    (root / "afile").write_text("not a checkpoint\n")
    got = {}
    for r in reports(mpirun(2, "tests/workers/ckpt_save_cases.py", root, timeout=240)):
        got.setdefault(r["case"], {})[r["rank"]] = r
    return root, got


def same_error(got, case):
    """The case's error, checked to be the same on both ranks."""
    ranks = got[case]
    assert sorted(ranks) == [0, 1], ranks
    assert ranks[0]["error"] == ranks[1]["error"], ranks
    return ranks[0]["error"]


def test_parent_passed_by_mistake_keeps_the_users_files(cases):
    root, got = cases
    err = same_error(got, "parent")
    assert "is a directory holding 2 entries (notes.txt, step-000100/) and no index.json" in err, err
    assert "not a pdist checkpoint" in err and os.path.join("parent", "step-000100") in err, err
    assert (root / "parent" / "notes.txt").read_text() == "my notes\n"
    assert (root / "parent" / "step-000100" / "model.bin").read_bytes() == b"the user's weights"
    assert sorted(os.listdir(root / "parent")) == ["notes.txt", "step-000100"]
    assert not [n for n in os.listdir(root) if ".pdist-" in n]


def test_a_regular_file_at_the_path_is_refused(cases):
    root, got = cases
    err = same_error(got, "file")
    assert "afile is a regular file, not a pdist checkpoint" in err, err
    assert (root / "afile").read_text() == "not a checkpoint\n"


@pytest.mark.parametrize("keep", [-5, 0, "2", True])
def test_keep_must_be_a_positive_int(cases, keep):
    root, got = cases
    err = same_error(got, f"keep={keep!r}")
    assert err.startswith(f"keep={keep!r}: must be") and "nothing was written" in err, err
    assert not os.path.exists(root / "bad")                 # not even the parent


def test_nan_in_extra_is_refused_before_any_file_is_written(cases):
    root, got = cases
    err = same_error(got, "nan")
    assert "extra['loss'] = nan: not finite" in err, err
    assert not os.path.exists(root / "nan")


def test_keep_prunes_only_this_runs_checkpoints(cases):
    root, got = cases
    runs_dir = root / "runs"
    first = got["new-run 100"][0]                             # keep=1 beside another run's step-000900
    assert first["error"] is None and first["names"] == ["step-000100", "step-000900"], first
    assert first["latest"] == str(runs_dir / "step-000100"), first
    second = got["new-run 200"][0]
    assert second["names"] == ["step-000200", "step-000900"], second      # its own older one goes
    assert same_error(got, "exists").endswith("is already a pdist checkpoint (step 300); pass overwrite=True to "
                                              "replace it (the old one stays whole until the new one is "
                                              "complete), or save to a new directory (nothing was written)")
    assert got["overwrite"][0]["error"] is None and got["resume"][0]["error"] is None
    assert sorted(os.listdir(runs_dir)) == ["step-000300", "step-000400", "step-000900"]
    idx = {n: verify(runs_dir / n) for n in os.listdir(runs_dir)}
    assert idx["step-000300"]["step"] == 301                  # overwritten
    assert idx["step-000400"]["run_id"] == idx["step-000300"]["run_id"] != idx["step-000900"]["run_id"]
    assert checkpoint.latest(runs_dir) == str(runs_dir / "step-000400")


def test_a_failed_write_on_one_rank_fails_everywhere_and_leaves_nothing(cases):
    root, got = cases
    err = same_error(got, "full-disk")
    assert "rank-00001.safetensors: writing failed on rank 1" in err and "File too large" in err, err
    assert "nothing was left behind" in err, err
    assert got["after-full-disk"][0]["error"] is None and got["after-full-disk"][1]["error"] is None
    assert os.listdir(root / "disk") == ["step-000001"]
    assert verify(root / "disk" / "step-000001")["step"] == 1


def one(*args, timeout=120):
    """Run the single-process worker; (rc, its report or None, output)."""
    run = launch(1, ONE, *map(str, args), timeout=timeout, wrap=False)
    found = reports(run.out)
    return run.rc, (found[0] if found else None), run.out


def test_an_interrupted_save_leaves_named_leftovers_that_the_next_save_cleans(tmp_path):
    rc, rep, out = one("kill-mid-write", tmp_path / "step-000001", 1)
    assert rc == -9 and rep is None, out
    left = sorted(os.listdir(tmp_path))
    assert left[0] == ".step-000001.pdist-lock" and left[1].startswith(".step-000001.pdist-tmp-"), left
    assert len(left) == 2, left
    rc, rep, out = one("save", tmp_path / "step-000002", 2)       # another name in the parent
    assert rc == 0 and rep["error"] is None, out
    assert os.listdir(tmp_path) == ["step-000002"]
    rc, _, out = one("kill-mid-write", tmp_path / "step-000003", 3)
    assert rc == -9, out
    rc, rep, out = one("save", tmp_path / "step-000003", 3)       # the same name: its stale lock is taken over
    assert rc == 0 and rep["error"] is None, out
    assert sorted(os.listdir(tmp_path)) == ["step-000002", "step-000003"]
    assert verify(tmp_path / "step-000003")["step"] == 3


def test_sigkill_between_the_renames_of_an_overwrite_leaves_latest_a_checkpoint(tmp_path):
    target = tmp_path / "step-000001"
    assert one("save", target, 1)[1]["error"] is None
    rc, _, out = one("kill-between", target, 2)
    assert rc == -9, out
    assert not os.path.exists(target)                          # killed with the name missing
    found = checkpoint.latest(tmp_path)
    assert found is not None and os.path.basename(found).startswith(".step-000001.pdist-old-"), found
    assert verify(found)["step"] == 1                          # the old one, complete
    assert one("save", tmp_path / "step-000002", 2)[1]["error"] is None      # the next save restores it
    assert sorted(os.listdir(tmp_path)) == ["step-000001", "step-000002"]
    assert verify(target)["step"] == 1


def _background(args, box):
    box["result"] = one(*args)


def test_two_concurrent_writers_get_one_clear_error(tmp_path):
    target, go = tmp_path / "ckpt", tmp_path.parent / f"{tmp_path.name}-go"
    box = {}
    holder = threading.Thread(target=_background, args=(("hold", target, 1, go), box))
    holder.start()
    try:
        lock, t0 = tmp_path / ".ckpt.pdist-lock", time.monotonic()
        while not lock.exists() and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        pid = json.loads(lock.read_text())["pid"]
        rc, rep, out = one("save", target, 2, "--overwrite")
        assert rc == 0 and rep is not None, out                  # a CheckpointError, not a raw crash
        assert f"another save is writing this checkpoint (lock {lock} held by pid {pid}" in rep["error"], rep
    finally:
        go.write_text("go")
        holder.join(150)
    rc, rep, out = box["result"]
    assert rc == 0 and rep["error"] is None, out
    assert os.listdir(tmp_path) == ["ckpt"]                      # no temporary directory, no lock
    assert verify(target)["step"] == 1


def test_many_writers_at_once_each_succeed_or_get_a_checkpoint_error(tmp_path):
    target, boxes = tmp_path / "ckpt", [{} for _ in range(4)]
    threads = [threading.Thread(target=_background, args=(("save", target, 10 + i, "--overwrite"), b))
               for i, b in enumerate(boxes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    errors = []
    for b in boxes:
        rc, rep, out = b["result"]
        assert rc == 0 and rep is not None, out
        errors.append(rep["error"])
    assert None in errors, errors
    assert all(e is None or "another save is writing this checkpoint" in e for e in errors), errors
    assert os.listdir(tmp_path) == ["ckpt"]
    assert verify(target)["step"] in {10 + i for i, e in enumerate(errors) if e is None}


def test_a_lock_is_stale_only_when_its_process_is_gone(tmp_path):
    dir = str(tmp_path / "ckpt")
    held = owner.Lock(dir).acquire()
    with pytest.raises(CheckpointError, match=f"held by pid {os.getpid()} on host"):
        owner.Lock(dir).acquire()
    held.release()
    me = {"pid": os.getpid(), "host": socket.gethostname(), "nonce": "x"}
    for holder, stale in ((dict(me, start=-1), True),                 # our pid, reused: another process's
                          (dict(me, pid=2 ** 22 + 12345), True),      # no such process
                          (dict(me, host="elsewhere"), False)):       # cannot tell: assume it runs
        with open(owner.lock_name(dir), "w") as f:
            json.dump(holder, f)
        if stale:
            owner.Lock(dir).acquire().release()
        else:
            with pytest.raises(CheckpointError, match="host elsewhere"):
                owner.Lock(dir).acquire()
        assert os.path.exists(owner.lock_name(dir)) != stale
        if not stale:
            os.unlink(owner.lock_name(dir))


def test_overwrite_and_keep_never_delete_files_pdist_did_not_write(tmp_path):
    from pdist.course import lesson
    from pdist.models.gpt import GPT
    cfg = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg, 0)
    checkpoint.save(model, None, tmp_path / "step-000001", 1)
    checkpoint.save(model, None, tmp_path / "step-000002", 2)
    (tmp_path / "step-000001" / "notes.txt").write_text("mine\n")
    with pytest.raises(CheckpointError, match=r"also holds files pdist did not write \(notes.txt\)"):
        checkpoint.save(model, None, tmp_path / "step-000001", 1, overwrite=True)
    with pytest.warns(UserWarning, match="notes.txt, which pdist did not write"):
        checkpoint.save(model, None, tmp_path / "step-000003", 3, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-000001", "step-000003"]       # step-000002 pruned
    assert verify(tmp_path / "step-000001")["step"] == 1
    assert (tmp_path / "step-000001" / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("links", [True, False])
def test_the_lock_is_created_whole_and_leaves_no_name_of_its_own(tmp_path, monkeypatch, links):
    """The lock's JSON is in the file from the moment the lock's name exists (hard-linked from
    a name of the writer's own), or, on a file system without hard links, O_EXCL and a write;
    either way a second taker is refused and only the lock itself is left in the parent."""
    seen = []
    real_link = os.link

    def link(src, dst):
        seen.append(json.loads(open(src).read()))          # whole before it gets the lock's name
        if not links:
            raise PermissionError(1, "no hard links here")
        return real_link(src, dst)
    monkeypatch.setattr(owner.os, "link", link)
    lock = owner.Lock(str(tmp_path / "ckpt")).acquire()
    try:
        assert seen and seen[0]["pid"] == os.getpid()
        assert json.loads((tmp_path / ".ckpt.pdist-lock").read_text())["nonce"] == lock.held["nonce"]
        assert os.listdir(tmp_path) == [".ckpt.pdist-lock"]
        with pytest.raises(CheckpointError, match="another save is writing this checkpoint"):
            owner.Lock(str(tmp_path / "ckpt")).acquire()
        assert os.listdir(tmp_path) == [".ckpt.pdist-lock"]
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []


def test_a_killed_writers_lock_temporaries_are_cleaned_only_when_old_and_dead(tmp_path):
    """A writer killed between creating its lock's temporary name and unlinking it leaves
    ``.<base>.pdist-lock.new-<pid>-<hex>`` (or ``.stale-``). The next save's cleaning removes such
    a file once it is LOCK_GRACE_S old and its pid runs nothing here; a fresh one, one whose pid
    is alive, a directory and a name that is not pdist's stay."""
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    old = time.time() - 2 * owner.LOCK_GRACE_S
    names = {f".ck.pdist-lock.new-{dead}-deadbeef": (old, True), f".ck.pdist-lock.stale-{dead}-0123abcd": (old, True),
             f".ck.pdist-lock.new-{dead}-cafebabe": (None, False), f".ck.pdist-lock.new-{os.getpid()}-aaaaaaaa":
             (old, False), ".ck.pdist-lock.new-mine": (old, False), f".ck.pdist-lock.new-{dead}-0000": (old, False)}
    for n, (t, _) in names.items():
        (tmp_path / n).write_text("{}")
        if t is not None:
            os.utime(tmp_path / n, (t, t))
    os.mkdir(tmp_path / f".ck.pdist-lock.new-{dead}-bbbbbbbb")
    os.utime(tmp_path / f".ck.pdist-lock.new-{dead}-bbbbbbbb", (old, old))
    done = owner.clean_leftovers(tmp_path)
    assert sorted(done) == sorted(n for n, (_, gone) in names.items() if gone), done
    assert sorted(os.listdir(tmp_path)) == sorted([n for n, (_, gone) in names.items() if not gone]
                                                  + [f".ck.pdist-lock.new-{dead}-bbbbbbbb"])
