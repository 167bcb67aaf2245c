"""The student copy (pdist/course/handout.py): no file of it holds a reference answer or a
wrong-answer fixture's near-answer (compared as ASTs, function by function), its exercises
are blank, its grader says "not started" for all and refuses --reference with the reason,
and its own stub tests pass with a student's answers written in. (The instructor copy's
--reference = 100/100 is tests/test_grade.py's test_reference_gets_full_points.)"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdist.course import grade, handout

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "pdist" / "course" / "solutions.py"
WRONG = ROOT / "tests" / "fixtures" / "wrong"
pytestmark = pytest.mark.skipif(not SOLUTIONS.is_file(), reason="a student copy: nothing withheld to look for")


def bodies(tree):
    """{ast dump of a function's body without its docstring: 'name (where)'} for every function."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if (node.body and isinstance(node.body[0], ast.Expr)
                                     and isinstance(node.body[0].value, ast.Constant)) else node.body
            if body and not (len(body) == 1 and isinstance(body[0], (ast.Pass, ast.Return, ast.Raise))):
                out[ast.dump(ast.Module(body=body, type_ignores=[]))] = node.name
    return out


def answers():
    """The functions of the reference answers and of every wrong-answer fixture, less the few
    that are line for line the library's own code (the library ships by design: e.g. Megatron's
    g forward is pdist's ReduceFromTensorParallel.forward). Returns (answers, shared with the library)."""
    found = {k: f"{f.name}:{v}" for f in SOLUTIONS.parent.glob("solutions*.py")     # solutions_moe.py: ex 12
             for k, v in bodies(ast.parse(f.read_text())).items()}
    for f in WRONG.glob("*/*.py"):
        found.update({k: f"{f.parent.name}/{f.name}:{v}" for k, v in bodies(ast.parse(f.read_text())).items()})
    library = {}
    for f in (ROOT / "pdist").rglob("*.py"):
        if f.parent != SOLUTIONS.parent or not f.name.startswith("solutions"):
            library.update(bodies(ast.parse(f.read_text())))
    shared = sorted(found.pop(k) for k in list(found) if k in library)
    return found, shared


def run(copy, *args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(copy))
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    dest = tmp_path_factory.mktemp("handout") / "course"
    files = handout.write_handout(dest, ROOT)
    assert files and (dest / "Makefile").is_file()
    return dest


def test_no_file_of_the_copy_holds_an_answer(copy):
    want, shared = answers()
    assert len(want) > 20                                  # the comparison has something to find
    # what the library itself holds, line for line: a one-line helper and Megatron's g forward, no more
    assert {x.split(":")[-1] for x in shared} <= {"_numel", "forward"}, shared
    hits, importers = [], set()
    for f in copy.rglob("*"):
        if ".git" in f.relative_to(copy).parts or not f.is_file():
            continue
        rel = f.relative_to(copy).as_posix()
        assert not handout.withheld(rel), rel
        if f.suffix == ".py":
            tree = ast.parse(f.read_text())
            hits += [f"{rel}:{name} is {want[k]}" for k, name in bodies(tree).items() if k in want]
            importers |= {rel for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (
                "solutions" in (n.module or "") or any(a.name == "solutions" for a in n.names))}
    assert not hits, hits
    assert importers == {"pdist/course/common.py"}, importers    # only --reference's loader, which says it is absent
    assert not (copy / "pdist" / "course" / "solutions.py").exists() and not (copy / "tests" / "fixtures" / "wrong").exists()


def test_copy_exercises_are_blank_and_its_grader_says_not_started(copy):
    for _, fname, _, _, _ in grade.EXERCISES:
        assert grade.not_started(copy / "lessons" / "exercises" / fname), fname
    p = run(copy, "-m", "pdist.grade", "--json", timeout=60)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert [r["status"] for r in res["exercises"]] == ["not started"] * len(grade.EXERCISES), res
    p = run(copy, "-m", "pdist.grade", "--reference", timeout=60)
    assert p.returncode != 0 and "not in a student copy" in p.stderr, (p.returncode, p.stderr)


def test_copy_is_its_own_git_repo_with_one_commit(copy):
    log = subprocess.run(["git", "-C", str(copy), "log", "--format=%s", "handout"], capture_output=True, text=True)
    if log.returncode != 0:
        pytest.skip(f"git is not usable here: {log.stderr.strip()}")
    assert log.stdout.strip().splitlines() == ["pdist course: student copy"]


def test_student_answers_never_fail_the_copy_stub_tests(copy):
    """A student writes an answer (here a wrong one, to be sure it is not blank) into the copy's
    lessons/exercises/, then runs the copy's own stub tests: they read the blank stubs from
    the handout commit and pass."""
    ex = copy / "lessons" / "exercises" / "ex08_one_f_one_b.py"
    ex.write_text((WRONG / "warmup_off_by_one" / "ex08_one_f_one_b.py").read_text())
    assert not grade.not_started(ex)
    p = run(copy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_grade.py",
            "-k", "stub or reference or wrong", timeout=200)
    assert p.returncode == 0 and "passed" in p.stdout, p.stdout[-3000:]
    assert "skipped" in p.stdout                            # --reference and the fixtures: not in a copy


def test_blank_stub_without_git_is_none_once_answered(tmp_path):
    (tmp_path / "lessons" / "exercises").mkdir(parents=True)
    name = "ex09_resharding.py"
    f = tmp_path / "lessons" / "exercises" / name
    f.write_text(handout.blank_stub(name, ROOT))
    assert handout.blank_stub(name, tmp_path) == f.read_text()
    f.write_text("def plan_reads(saved, offsets, shape):\n    return []\n")
    assert handout.blank_stub(name, tmp_path) is None


def test_handout_refuses_a_folder_inside_the_repo_or_not_empty(tmp_path):
    with pytest.raises(SystemExit, match="inside the repository"):
        handout.write_handout(ROOT / "out" / "copy", ROOT)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty"):
        handout.write_handout(tmp_path / "x", ROOT)
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
