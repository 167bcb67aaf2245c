"""``python -m pdist.train`` (issue 31, item 2; pdist/train/).

One 4-rank launch (tests/workers/train_runs.py) trains dp 2 x tp 2 for 2 steps and saves, resumes
that checkpoint at dp 4 to step 4 (its flags from a TOML config file, its data the same ids as a
.bin token file), and trains dp 4 uninterrupted to step 4. The resumed run equals the
uninterrupted one, every parameter and Adam's m and v (float64, rtol 1e-9: the layouts sum in
other orders), at the saved step and at the end. The flags' errors are checked in-process (no
MPI): each names its flag. One process runs the real command line with a JSON config.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from pdist import data
from pdist.checkpoint import consolidate
from pdist.checkpoint.format import read_tensors, verify
from pdist.testing import mpirun, reports
from pdist.train import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ids():
    text = data.stdlib_corpus(12_000)
    return data.CharTokenizer(text).encode(text)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    a = ids()
    np.save(d / "ids.npy", a.astype(np.int32))
    a.astype(np.uint16).tofile(d / "ids.bin")
    (d / "b.toml").write_text(
        f'data = "{d / "ids.bin"}"\ntoken-dtype = "uint16"\ndp = 4\nbatch_size = 8\nn_layer = 2\nn_head = 2\n'
        'n_embd = 16\nblock_size = 8\ndtype = "float64"\nlr_schedule = "constant"\nwarmup = 0\n'
        'eval_every = 2\nlog_every = 1\nsteps = 99\n')        # the command line's --steps 4 wins
    out = mpirun(4, "tests/workers/train_runs.py", str(d), timeout=240)
    return d, out


def same(x, y):
    a, b = read_tensors(str(x)), read_tensors(str(y))
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optimizer.exp_avg.") for k in a)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-9, atol=1e-12 * np.abs(b[k]).max(), err_msg=k)


def test_resumed_at_dp4_equals_the_uninterrupted_dp4_run(runs):
    d, out = runs
    assert [r["codes"] for r in reports(out)] == [{"A": 0, "B": 0, "C": 0, "D": 2}] * 4, out[-3000:]
    same(d / "A/ckpt/step-000002", d / "C/ckpt/step-000002")     # dp 2 x tp 2 == dp 4 at the saved step
    same(d / "A/ckpt/step-000004", d / "C/ckpt/step-000004")     # resumed at dp 4 == uninterrupted dp 4
    assert "resumed from" in out and "ckpt/step-000002 at step 2" in out
    assert "cannot continue this run" in out and "n_embd: checkpoint 16 vs model 32" in out    # D


def test_log_lines_and_progress(runs):
    d, out = runs
    recs = [json.loads(line) for line in (d / "A/log.jsonl").read_text().splitlines()]
    starts = [r for r in recs if r.get("event") == "start"]
    assert [(s["step"], s["layout"]["dp"], s["layout"]["tp"]) for s in starts] == [(0, 2, 2), (2, 4, 1)]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 4]
    assert [r["step"] for r in recs if r.get("event") == "save"] == [2, 4]
    assert [r["reason"] for r in recs if r.get("event") == "end"] == ["done", "done"]
    steps = [r for r in recs if "loss" in r]
    assert all(np.isfinite(r["loss"]) and r["lr"] == 3e-3 for r in steps)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] for r in steps if r["step"] in (2, 4))   # (1, 3: first)
    assert "[####################] 4/4  loss" in out and "tok/s  MFU" in out and "ETA" in out


def error(argv, capsys, world=4):
    with pytest.raises(SystemExit) as e:
        flags.parse(argv, world=world)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--tp", "3"], "--tp 3 x --pp 1 x --cp 1 = 3 does not divide the world (4 ranks)"),
    (["--dp", "2"], "--dp 2 x --cp 1 x --tp 1 x --pp 1 = 2, but the world has 4 rank(s)"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--zero", "5"], "argument --zero: invalid choice"),
    (["--n-embd", "30"], "--n-embd (30) must be divisible by --n-head (4)"),
    (["--batch-size", "6"], "--batch-size 6 must divide by --dp x --microbatches = 4"),
    (["--data", "/nonexistent/x.txt"], "--data /nonexistent/x.txt: no such file"),
    (["--resume", "--out", "/tmp"], "--resume: no complete checkpoint under /tmp/ckpt"),
    (["--from-pretrained", "/tmp"], "--from-pretrained /tmp: not a Hugging Face directory"),
    (["--sp"], "--sp (sequence parallelism) needs --tp > 1"),
    (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file"),
])
def test_flag_errors_name_the_flag(argv, says, capsys):
    assert says in error(argv, capsys)


def test_config_file_errors_and_precedence(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("n_layers = 3\n")
    assert "unknown key 'n_layers'" in error(["--config", str(tmp_path / "bad.toml")], capsys)
    (tmp_path / "bad.json").write_text('{"tp": "two"}')
    assert "argument --tp: invalid int value: 'two'" in error(["--config", str(tmp_path / "bad.json")], capsys)
    (tmp_path / "ok.json").write_text('{"tp": 2, "sp": true, "steps": 7}')
    args = flags.parse(["--config", str(tmp_path / "ok.json"), "--steps", "9"], world=4)
    assert (args.tp, args.dp, args.sp, args.steps) == (2, 2, True, 9)
    (tmp_path / "config.json").write_text("{}")
    assert "--from-pretrained takes the sizes from its config.json: drop --n-layer" in error(
        ["--from-pretrained", str(tmp_path), "--n-layer", "3"], capsys)


def test_layout_error_before_mpi_and_one_process_run(tmp_path):
    """The real command line, one process: a layout only the model can refuse is an argparse error
    (before MPI); a short run prints plain progress lines (stdout is a pipe) and writes its files."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "pdist.train"]
    two = dict(env, PMI_SIZE="2", PMI_RANK="0")       # as rank 0 of a 2-rank job: refused before MPI starts
    bad = subprocess.run(cmd + ["--n-expert", "2", "--cp", "2", "--out", str(tmp_path)], env=two,
                         capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert bad.returncode == 2 and "mixture-of-experts model (n_expert=2) does not run with context parallelism" \
        in bad.stderr, bad.stderr
    (tmp_path / "run.json").write_text(json.dumps({"steps": 3, "n_layer": 1, "n_embd": 16, "n_head": 2,
                                                   "block_size": 8, "batch_size": 4, "log_every": 1,
                                                   "eval_every": 3, "warmup": 1, "out": str(tmp_path / "o")}))
    ok = subprocess.run(cmd + ["--config", str(tmp_path / "run.json"), "--model", "llama", "--plot"], env=env,
                        capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "llama" in ok.stdout and "[####################] 3/3" in ok.stdout and "\r" not in ok.stdout
    assert (tmp_path / "o/ckpt/step-000003/index.json").is_file()
    if importlib.util.find_spec("matplotlib"):          # optional: without it --plot says so and writes none
        assert (tmp_path / "o/loss.png").is_file()
        assert (tmp_path / "o/waterfall.png").is_file() or "no waterfall yet" in ok.stdout
    else:
        assert "matplotlib is not installed" in ok.stdout + ok.stderr and not (tmp_path / "o/loss.png").exists()
    assert sum(1 for _ in open(tmp_path / "o/log.jsonl")) == 1 + 3 + 1 + 1 + 1    # start, steps, eval, save, end
    consolidate(str(tmp_path / "o/ckpt/step-000003"), str(tmp_path / "hf"))       # Hugging Face Llama dir
    hf = subprocess.run(cmd + ["--from-pretrained", str(tmp_path / "hf"), "--steps", "1", "--batch-size", "4",
                               "--out", str(tmp_path / "o2")], env=env, capture_output=True, text=True, timeout=120,
                        cwd=str(tmp_path))
    assert hf.returncode == 0 and "llama Ψ = " in hf.stdout and "L=1, h=2, C=16, T=8" in hf.stdout, hf.stdout + hf.stderr


@pytest.mark.cores(2)
def test_ctrl_c_stops_every_rank_after_one_step_and_leaves_whole_checkpoints(tmp_path):
    """SIGINT to mpiexec (a terminal's Ctrl-C) while 2 ranks train and save every 2 steps: both stop
    after the same step, exit 130 and clean, every checkpoint verifies, nothing else is left."""
    from test_launch_cleanup import kill_left, left_after, like_a_terminal
    from pdist.testing import mpiexec_path
    tag = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=ROOT, PDIST_TEST_TAG=tag)
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "pdist.train", "--steps", "100000", "--n-layer", "1",
           "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--batch-size", "4", "--eval-every", "0",
           "--save-every", "2", "--log-every", "1000", "--out", str(tmp_path)]
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, preexec_fn=like_a_terminal, cwd=str(tmp_path))
    log, mark = tmp_path / "log.jsonl", f"PDIST_TEST_TAG={tag}".encode()
    try:
        end = time.monotonic() + 90
        while time.monotonic() < end and not (log.exists() and log.read_text().count('"save"') >= 2):
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=60)[0]
        assert p.returncode == 130, out[-3000:]
        assert "SIGINT: every rank stopped after step" in out and "FAILED" not in out, out[-3000:]
        last = json.loads(log.read_text().splitlines()[-1])
        assert last["event"] == "end" and last["reason"] == "interrupted"
        names = sorted(os.listdir(tmp_path / "ckpt"))
        assert len(names) >= 2 and all(n.startswith("step-") for n in names), names     # no temporaries left
        for n in names:
            verify(str(tmp_path / "ckpt" / n))
        assert left_after(mark) == []
    finally:
        kill_left(p, mark)
