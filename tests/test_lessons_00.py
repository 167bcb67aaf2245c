"""lessons/00_autograd.py runs as a script, writes the JSON summary contract, and
its check fails when the gradients are wrong."""
import json
import os
import subprocess
import sys

from pdist import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LESSON = os.path.join(ROOT, "lessons", "00_autograd.py")


def run(tmp_path, *flags, env=None):
    out = tmp_path / "summary.json"
    p = subprocess.run([sys.executable, LESSON, "--json", str(out), *flags], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, **(env or {})})
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_lesson_00_json_summary(tmp_path):
    p, s = run(tmp_path, "--steps", "60", "--seed", "1", "--dtype", "float64")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("PASS: 00_autograd")
    assert "sample:" in p.stdout and "finite diff" in p.stdout
    assert s["lesson"] == "00_autograd" and s["world_size"] == 1 and s["check"] == "PASS"
    (r,) = s["runs"]
    assert r["name"] == "single"
    assert r["layout"] == {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0}
    assert r["dtype"] == "float64"
    V, C, T, L = data.char_dataset()[1].vocab_size, 64, 32, 2  # lesson.gpt_config
    assert r["params"] == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert len(r["loss"]) == 60 and all(isinstance(v, float) for v in r["loss"])
    assert r["loss"][-1] < r["loss"][0]
    assert 0 < r["seconds_per_step"] < 5
    assert all(abs(g["backward"] - g["finite_difference"]) < 1e-5 * abs(g["finite_difference"]) + 1e-9
               for g in r["grad_check"])


def test_lesson_00_is_deterministic_in_seed(tmp_path):
    _, a = run(tmp_path, "--steps", "5", "--seed", "3")
    _, b = run(tmp_path, "--steps", "5", "--seed", "3")
    assert a["runs"][0]["loss"] == b["runs"][0]["loss"]


def test_lesson_00_fails_when_a_gradient_is_wrong(tmp_path):
    # break GELU's backward in the lesson's process: the finite-difference check must catch it
    shim = tmp_path / "sitecustomize.py"
    shim.write_text("import pdist.engine.functional as F\n"
                    "_b = F.GELU.backward\n"
                    "F.GELU.backward = lambda self, g: _b(self, g) * 1.01\n")
    p, s = run(tmp_path, "--steps", "40", env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert p.returncode != 0
    assert p.stdout.strip().splitlines()[-1].startswith("FAIL: 00_autograd")
    assert s["check"] == "FAIL"
    assert any(abs(g["backward"] - g["finite_difference"]) > 1e-4 * abs(g["finite_difference"])
               for g in s["runs"][0]["grad_check"])


def test_lesson_00_rejects_bad_flags_before_training(tmp_path):
    """Every bad flag: argparse's usage message, exit code 2, no training, no summary."""
    cases = [(["--steps", "0"], "--steps must be >= 1, got 0"),
             (["--steps", "-1"], "--steps must be >= 1, got -1"),
             (["--seed", "-1"], "--seed must be >= 0, got -1"),
             (["--model", "bert"], "invalid choice: 'bert'"),
             (["--model", "llama", "--n-embd", "36"], "--model llama needs an even head size (RoPE)")]
    for flags, words in cases:
        p, s = run(tmp_path, *flags)
        assert p.returncode == 2 and words in p.stderr and "usage:" in p.stderr, p.stderr
        assert s is None and "GPT:" not in p.stdout and "Llama:" not in p.stdout
    missing = tmp_path / "no" / "such" / "dir" / "s.json"
    p = subprocess.run([sys.executable, LESSON, "--json", str(missing)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "does not exist" in p.stderr and "GPT:" not in p.stdout


def test_lesson_00_trains_llama(tmp_path):
    """--model llama: RMSNorm, SwiGLU, RoPE, grouped-query attention (2 kv heads), untied head."""
    p, s = run(tmp_path, "--model", "llama", "--steps", "60", "--seed", "1", "--dtype", "float64")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("PASS: 00_autograd")
    assert "Llama: 2 layers, 4 heads (2 kv)" in p.stdout
    (r,) = s["runs"]
    assert r["model"] == "llama" and r["loss"][-1] < r["loss"][0]
    V, C, I, L = data.char_dataset()[1].vocab_size, 64, 176, 2
    assert r["params"] == 2 * V * C + L * (C * C * 3 + 3 * C * I + 2 * C) + C   # q, o (C, C); k, v (C/2, C)
    names = {g["param"] for g in r["grad_check"]}
    assert {"lm_head.weight", "model.layers.1.mlp.gate_proj.weight", "model.norm.weight"} <= names


def test_lesson_00_llama_fails_when_a_gradient_is_wrong(tmp_path):
    shim = tmp_path / "sitecustomize.py"
    shim.write_text("import pdist.engine.activations as A\n"
                    "_b = A.SwiGLU.backward\n"
                    "A.SwiGLU.backward = lambda self, g: tuple(x * 1.01 for x in _b(self, g))\n")
    p, s = run(tmp_path, "--model", "llama", "--steps", "40", env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert p.returncode != 0 and s["check"] == "FAIL", p.stdout + p.stderr
