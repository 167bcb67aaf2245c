"""Rough edges that must end in a clear error, never a silent wrong answer:
PDIST_DEVICE / PDIST_MALLOC_TUNE values, a CuPy without a GPU, lesson flags
checked before training, and the JSON summary written atomically as strict JSON."""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pdist.course import lesson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_pdist(env, pythonpath=()):
    env = {k: v for k, v in os.environ.items() if k not in ("PDIST_DEVICE", "PDIST_MALLOC_TUNE")} | env
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), ROOT])
    code = "import pdist; from pdist.engine import backend; print(backend.device())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=60)


# --- PDIST_DEVICE ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["cpu", "CPU", "  cpu ", ""])
def test_pdist_device_cpu_spellings(value):
    p = import_pdist({"PDIST_DEVICE": value})
    assert p.returncode == 0 and p.stdout.strip() == "cpu", p.stderr


@pytest.mark.parametrize("value", ["cuda", "gpu0", "1", "cpu,gpu"])
def test_pdist_device_rejects_other_values(value):
    p = import_pdist({"PDIST_DEVICE": value})
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: PDIST_DEVICE=") and repr(value) in last
    assert "'cpu' or 'gpu'" in last


FAKE_CUPY = '''
import os
class CUDARuntimeError(RuntimeError):
    pass
class runtime:
    CUDARuntimeError = CUDARuntimeError
    @staticmethod
    def getDeviceCount():
        if os.environ.get("FAKE_CUPY_ZERO"):
            return 0
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")
class cuda:
    runtime = runtime
'''


@pytest.mark.parametrize("zero", [False, True])
def test_pdist_device_gpu_with_cupy_but_no_gpu(tmp_path, zero):
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    env = {"PDIST_DEVICE": " GPU "} | ({"FAKE_CUPY_ZERO": "1"} if zero else {})
    p = import_pdist(env, pythonpath=[tmp_path])
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: PDIST_DEVICE=gpu but CuPy finds no CUDA driver/GPU: "), p.stderr
    assert ("0 devices" in last) if zero else ("cudaErrorInsufficientDriver" in last)


# --- PDIST_MALLOC_TUNE -----------------------------------------------------------------------
def test_malloc_tune_flag(monkeypatch):
    from pdist.engine import host_memory
    monkeypatch.setenv("PDIST_MALLOC_TUNE", "off")
    assert host_memory.tune_malloc() is False
    monkeypatch.setenv("PDIST_MALLOC_TUNE", "maybe")
    with pytest.raises(ValueError, match="PDIST_MALLOC_TUNE='maybe'"):
        host_memory.tune_malloc()
    p = import_pdist({"PDIST_MALLOC_TUNE": "2"})
    assert p.returncode != 0 and "PDIST_MALLOC_TUNE='2'" in p.stderr
    assert import_pdist({"PDIST_MALLOC_TUNE": "No"}).returncode == 0


# --- lesson.validate: bad flags stop every rank before training, exit code 2 -------------------
def make_parser():
    p = argparse.ArgumentParser(prog="lesson")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p


def check_rejected(p, argv, capsys, words):
    with pytest.raises(SystemExit) as e:
        lesson.validate(p, p.parse_args(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and all(w in err for w in words), err


@pytest.mark.parametrize("argv,words", [
    (["--steps", "0"], ["--steps must be >= 1, got 0"]),
    (["--steps", "-1"], ["--steps must be >= 1, got -1"]),
    (["--seed", "-3"], ["--seed must be >= 0, got -3"]),
    (["--json", "/no/such/dir/out.json"], ["--json /no/such/dir/out.json", "does not exist"]),
    (["--json", "/proc/out.json"], ["cannot create a file"]),
])
def test_validate_rejects_shared_flags(argv, words, capsys):
    check_rejected(make_parser(), argv, capsys, words)


def test_validate_rejects_json_dir_and_file_parent(tmp_path, capsys):
    check_rejected(make_parser(), ["--json", str(tmp_path)], capsys, ["is a directory"])
    (tmp_path / "f").write_text("x")
    check_rejected(make_parser(), ["--json", str(tmp_path / "f" / "s.json")], capsys, ["does not exist"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_validate_rejects_read_only_dir(tmp_path, capsys):
    d = tmp_path / "ro"
    d.mkdir(mode=0o555)
    check_rejected(make_parser(), ["--json", str(d / "s.json")], capsys, ["cannot create a file"])


def test_validate_checks_only_the_flags_args_has(tmp_path, capsys):
    p = make_parser()
    for name in ("--batch-size", "--n-layer", "--n-head", "--n-embd", "--block-size", "--micro-batches"):
        p.add_argument(name, type=int, default=None)
    args = lesson.validate(p, p.parse_args(["--json", str(tmp_path / "s.json"), "--n-head", "4",
                                            "--n-embd", "64"]))
    assert args.n_head == 4 and list(tmp_path.iterdir()) == []  # the probe file is removed
    for name in ("--batch-size", "--n-layer", "--n-head", "--n-embd", "--block-size", "--micro-batches"):
        check_rejected(p, [name, "0"], capsys, [f"{name} must be >= 1, got 0"])
    check_rejected(p, ["--batch-size", "-2"], capsys, ["--batch-size must be >= 1"])
    check_rejected(p, ["--n-embd", "30", "--n-head", "4"], capsys, ["divisible"])
    # a namespace without any of the checked attributes passes untouched
    assert lesson.validate(p, argparse.Namespace(dtype="float32")).dtype == "float32"


def run_lesson_01(*flags):
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    script = os.path.join(ROOT, "lessons", "01_collectives.py")
    return subprocess.run([mpirun, "-n", "2", sys.executable, script, *flags], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("flags,words", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--sizes-kib", "64,0"], "--sizes-kib must be comma-separated integers >= 1"),
    (["--sizes-kib", "big"], "--sizes-kib must be comma-separated integers >= 1"),
])
def test_lesson_01_rejects_bad_flags_on_every_rank(flags, words):
    p = run_lesson_01(*flags)
    assert p.returncode != 0
    assert p.stderr.count(words) == 2, p.stdout + p.stderr  # both ranks, before any collective
    assert "==" not in p.stdout  # no demo or table ran


# --- lesson.finish: strict JSON, written atomically --------------------------------------------
def test_finish_writes_strict_json_with_null_for_non_finite(tmp_path, capsys):
    out = tmp_path / "s.json"
    runs = [{"loss": [2.0, math.nan, np.float32(np.inf)], "arr": np.array([1.0, -np.inf]),
             "nested": {"x": (np.float64(np.nan), 3)}, "n": np.int64(7)}]
    lesson.finish("x", True, runs, argparse.Namespace(json=str(out)))
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    s = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    assert s["runs"] == [{"loss": [2.0, None, None], "arr": [1.0, None], "nested": {"x": [None, 3]}, "n": 7}]
    assert s["check"] == "PASS" and "PASS: x" in capsys.readouterr().out
    assert os.stat(out).st_mode & 0o044  # an ordinary, readable file (not mkstemp's 0600)


def test_finish_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "s.json"
    out.write_text('{"old": true}')
    # a value that cannot be written: the old file stays whole, no temporary file is left
    with pytest.raises(TypeError):
        lesson.finish("x", True, [{"bad": object()}], argparse.Namespace(json=str(out)))
    assert json.loads(out.read_text()) == {"old": True} and os.listdir(tmp_path) == ["s.json"]
    # the new file is a temporary in the same directory, fsync'ed, then renamed over the old one
    calls = []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append(("replace", a, b)) or real_replace(a, b))
    lesson.finish("x", True, [], argparse.Namespace(json=str(out)))
    kinds = [c[0] for c in calls]
    assert "fsync" in kinds and "replace" in kinds and kinds.index("fsync") < kinds.index("replace")
    _, src, dst = calls[kinds.index("replace")]
    assert os.path.dirname(src) == str(tmp_path) and dst == str(out)
    assert json.loads(out.read_text())["lesson"] == "x" and os.listdir(tmp_path) == ["s.json"]
