"""The student copy of the course: ``make handout DIR=PATH``, ``python -m pdist.course handout PATH``.

Contract. ``write_handout(dest)`` copies the repository's tracked files (``git ls-files``;
without git, a walk that skips .git, .venv, caches and build output) into ``dest``, except
what holds or nearly holds the reference answers (``WITHHELD``: pdist/course/solutions.py and
the grader's wrong-answer fixtures under tests/fixtures/wrong/). Every exercise file in
lessons/exercises/ is written blank (``blank_stub``), never the instructor's working copy,
and is checked to be blank ("not started" for the grader) before the copy is declared done.
The copy becomes a fresh git repository with one commit, tagged ``handout``, so a student
can ``git diff handout`` to see what they wrote. In it ``make grade`` grades the student's
files; ``--reference`` says the answers are not there (common.reference_available).

``blank_stub(name)`` is the one place the blank exercise text comes from: the working file
when it is still blank, else the committed one (the ``handout`` tag in a student copy,
``HEAD`` in the instructor's checkout), else None. The test suite's stub checks read it, so
a student's answers in lessons/exercises/ never fail ``make test``.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXERCISES = Path("lessons") / "exercises"
SOLUTIONS = Path("pdist") / "course" / "solutions.py"
WITHHELD = (SOLUTIONS.as_posix(), "tests/fixtures/wrong/", "pdist/course/solutions_moe.py")   # (12's answer)
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", "build", "dist", "out", ".ruff_cache"}
TAG = "handout"


def _git(root, *args):
    try:
        p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def tracked_files(root=ROOT):
    """Repository-relative posix paths of the files to copy (git's list, or a filtered walk)."""
    out = _git(root, "ls-files", "-z")
    if out is not None:
        return sorted(f for f in out.split("\0") if f and (Path(root) / f).is_file())
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info"))
        for n in names:
            if not n.endswith((".pyc", ".pyo")):
                files.append((Path(d) / n).relative_to(root).as_posix())
    return sorted(files)


def withheld(rel):
    """True for a path the student copy must not hold (the answers or near-answers)."""
    return rel == WITHHELD[0] or any(rel.startswith(w) for w in WITHHELD[1:])


def blank_stub(name, root=ROOT):
    """The blank text of exercise file ``name`` (e.g. "ex01_ring_allreduce.py"), or None."""
    from pdist.course.grade import not_started     # (grade never imports handout)
    path = Path(root) / EXERCISES / name
    if path.is_file() and _blank_text(path.read_text(), not_started):
        return path.read_text()
    for rev in (TAG, "HEAD"):
        text = _git(root, "show", f"{rev}:{(EXERCISES / name).as_posix()}")
        if text is not None:
            return text if _blank_text(text, not_started) else None
    return None


def _blank_text(text, not_started):
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    try:
        return not_started(f.name)
    except SyntaxError:
        return False
    finally:
        os.unlink(f.name)


def write_handout(dest, root=ROOT, git=True):
    """Write the student copy into ``dest`` (absent or empty). Returns the list of files written."""
    from pdist.course.grade import EXERCISES as TABLE
    dest, root = Path(dest).resolve(), Path(root).resolve()
    if dest == root or root in dest.parents:
        raise SystemExit(f"pdist.course handout: {dest} is inside the repository {root}; choose a folder outside it")
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"pdist.course handout: {dest} is not empty; give a new or empty folder")
    stubs = {}
    for ex in TABLE:
        text = blank_stub(ex[1], root)
        if text is None:
            raise SystemExit(f"pdist.course handout: no blank {EXERCISES / ex[1]} (neither the working file nor "
                             f"git HEAD's is a blank stub); restore it with `git checkout -- {EXERCISES / ex[1]}`")
        stubs[(EXERCISES / ex[1]).as_posix()] = text
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        raise SystemExit(f"pdist.course handout: {tmp} exists (an interrupted handout?); remove it first")
    written = []
    for rel in tracked_files(root):
        if withheld(rel):
            continue
        out = tmp / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if rel in stubs:
            out.write_text(stubs[rel])
        else:
            shutil.copy2(root / rel, out)
        written.append(rel)
    missing = sorted(set(stubs) - set(written))
    for rel in missing:                       # an exercise file that git does not track yet
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(stubs[rel])
        written.append(rel)
    if git:
        _commit(tmp)
    if dest.exists():
        dest.rmdir()                          # empty, checked above
    os.replace(tmp, dest)
    return sorted(written)


def _commit(path):
    ident = ["-c", "user.name=pdist handout", "-c", "user.email=handout@pdist.invalid", "-c", "commit.gpgsign=false"]
    steps = [["init", "-q"], ["add", "-A"], [*ident, "commit", "-q", "-m", "pdist course: student copy"],
             ["tag", TAG]]
    for s in steps:
        if _git(path, *s) is None:
            print(f"pdist.course handout: `git {' '.join(s)}` failed in {path}; the copy is written without "
                  f"its own git history", file=sys.stderr)
            shutil.rmtree(path / ".git", ignore_errors=True)
            return False
    return True


def main(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        raise SystemExit("usage: python -m pdist.course handout DIR   (DIR: a new folder outside the repository)")
    files = write_handout(argv[0])
    print(f"wrote the student copy to {argv[0]}: {len(files)} files, the exercises blank, without "
          f"{', '.join(WITHHELD)}; hand it out, then grade with `python -m pdist.grade --class DIR --csv OUT`")
    return 0
