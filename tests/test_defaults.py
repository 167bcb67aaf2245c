"""No silent wrong answer by default; every environment variable and flag checked up front
(issue 30, items 3, 4, 8). One scenario per defect; the distributed ones under a real
``mpiexec`` (pdist.testing.launch), every rank's report checked, and no process of the job
left behind (each launch is tagged with a token in its environment, looked for in /proc)."""
import hashlib
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import pdist
from pdist.testing import launch, reports
from shared_launch import jobs, mpirun_shared, selected, session, stops

ROOT = Path(pdist.__file__).resolve().parent.parent     # the checkout whose pdist and lessons run
W = Path(__file__).parent / "workers"
LESSONS = ROOT / "lessons"
BATCH_HEAD = ("every rank must pass the same global batch (x, y) to local_batch() (get_batch(step) must "
              "return it on every rank); rank 1's differs from rank 0's: seed the loader with the step, not the rank")


def leftovers(token):
    """PIDs of processes whose environment holds ``PDIST_TEST_TOKEN=token``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"PDIST_TEST_TOKEN={token}".encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def job(n, script, env, tmp_path):
    """``launch`` with a token in the environment; asserts the job ended by itself and that
    none of its processes outlived it."""
    token = uuid.uuid4().hex
    res = launch(n, script, timeout=120, wrap=False,
                 env={"PDIST_TEST_TOKEN": token, "PDIST_TIMEOUT": "20", "PDIST_FLIGHT_DIR": tmp_path, **env})
    assert not res.timed_out, f"the harness had to kill {script}\n{res.out[-3000:]}"
    assert leftovers(token) == [], f"processes of {script} outlived the job"
    return res


# The 2-rank scenarios that end by themselves (an error raised on every rank, reported; a usage error before any
# collective, captured) are jobs of one launch (tests/workers/jobs.py): that one, those that pass, those that raise.
JOBS = [("test_inject_of_a_rank_that_does_not_exist_is_a_usage_error_on_every_rank", "inject",
         stops(LESSONS / "02_data_parallel.py", "--steps", "2", "--inject", "nan:rank=5,step=1"))]
JOBS += [(f"test_batch_check_passes_the_same_batch_and_can_be_switched_off[{k}]", k, [W / "defaults_batch.py", *a])
         for k, a in [("same batch dp", ("dp", "step")), ("same batch pp", ("pp", "step")), ("check off", ("tp", "rank", "off"))]]
JOBS += [("test_ddp_nan_on_one_rank_stops_every_rank_by_default", c, [W / "defaults_finite.py", c])
         for c in ("ddp_off", "ddp")]
JOBS += [(f"test_per_rank_loader_is_caught_at_step_0_on_every_rank[{k}]", k, [W / "defaults_batch.py", k, "rank"])
         for k in ("dp", "tp", "pp", "dp_fp16")]
JOBS += [("test_fp16_skips_are_counted_and_k_in_a_row_stop_every_rank", "fp16", [W / "defaults_finite.py", "fp16"])]


def shared(request, job=None):
    """Job ``job``'s reports by rank (None: the output) of this session's 2-rank launch, which ended by itself."""
    token = f"defaults-{session()}"                  # one per suite: every worker asks the same launch
    out = mpirun_shared(2, *jobs({k: j for t, k, j in JOBS if t in selected(request)}), timeout=300,
                        env={"PDIST_TEST_TOKEN": token, "PDIST_TIMEOUT": "20"})
    assert leftovers(token) == [], "processes of the shared launch outlived it"
    got = reports(out, job=job)
    assert job is None or sorted(r["rank"] for r in got) == [0, 1], got
    return out if job is None else {r["rank"]: r for r in got}


def python(*args, env=None, timeout=120):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd=str(ROOT))


# ------------------------------------------------------------------ 1. the corpus
def test_corpus_is_the_same_whatever_the_process_imported():
    """typing_extensions (which torch imports) used to change typing's members, hence the corpus
    (it comes with torch and transformers; without it this half skips, the file check below runs)."""
    pytest.importorskip("typing_extensions")
    code = ("import hashlib, sys\n{pre}\nfrom pdist import data\n"
            "t, _ = data.char_dataset()\nprint(len(t), hashlib.sha256(t.tobytes()).hexdigest())")
    pre = "import typing_extensions\ntry:\n    import torch\nexcept ImportError:\n    pass"
    plain, extra = (python("-I", "-c", "import sys; sys.path.insert(0, %r)\n" % str(ROOT) + code.format(pre=p))
                    for p in ("", pre))
    assert plain.returncode == 0 and extra.returncode == 0, plain.stderr + extra.stderr
    assert plain.stdout.split() == extra.stdout.split(), (plain.stdout, extra.stdout)
    assert plain.stdout.split()[0] == "130644"


def test_corpus_is_the_bundled_file():
    """The corpus is pdist/corpus.txt, checked against its recorded sha256: never the live
    docstrings of whatever modules the process has loaded."""
    from pdist import data
    raw = Path(data.CORPUS_FILE).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == data.CORPUS_SHA256 and data.stdlib_corpus() == raw.decode()


# ------------------------------------------------------------------ 2. the batch check
@pytest.mark.parametrize("layout", ["dp", "tp", "pp", "dp_fp16"])
def test_per_rank_loader_is_caught_at_step_0_on_every_rank(layout, request):
    for r, rep in shared(request, layout).items():
        assert rep["error"] is not None and BATCH_HEAD in rep["error"], (r, rep)
        assert rep["error"].startswith("step 0:") and rep["steps_done"] == 0, (r, rep)


@pytest.mark.parametrize("args", [("dp", "step"), ("pp", "step"), ("tp", "rank", "off")],
                         ids=["same batch dp", "same batch pp", "check off"])
def test_batch_check_passes_the_same_batch_and_can_be_switched_off(args, request):
    got = shared(request, request.node.callspec.id)             # its job ran to the end (exit 0)
    assert all(rep["error"] is None and rep["steps_done"] == 3 for rep in got.values()), got


def test_batch_hash_cost_is_microseconds():
    """The stamp's hash of a lesson-size batch (16 x 32 int64, twice) is far below a step."""
    import time

    import numpy as np
    from pdist.comm.flight_recorder import batch_hash
    x = np.random.default_rng(0).integers(0, 96, (16, 32))
    t0 = time.perf_counter()
    for _ in range(1000):
        batch_hash(x, x)
    assert (time.perf_counter() - t0) / 1000 < 1e-3
    assert batch_hash(x, x) != batch_hash(x, x + 1) and batch_hash(x, x) == batch_hash(x.copy(), x.copy())


# ------------------------------------------------------------------ 3. check_finite by default
NAN_STEP = """
import numpy as np

from pdist import data
from pdist.course import lesson
from pdist.models.gpt import GPT
from pdist.parallel import Local


def nan_step(check_finite=None):
    \"\"\"One step of Local(GPT) with a NaN weight; check_finite=None: the default.\"\"\"
    tokens, tok = data.char_dataset(20_000)
    kw = {} if check_finite is None else {"check_finite": check_finite}
    m = Local(GPT(lesson.gpt_config(tok.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=8), 0), **kw)
    m.parameters()[0].data.reshape(-1)[0] = np.nan
    return m.forward_backward(*m.local_batch(*data.get_batch(tokens, 4, 8, 0, 0)))
"""


def _local_nan_step(check_finite=None):
    ns = {}
    exec(NAN_STEP, ns)
    return ns["nan_step"](check_finite)


def test_check_finite_is_on_by_default_in_one_process():
    from pdist.errors import NonFiniteError
    with pytest.raises(NonFiniteError, match="step 0: non-finite loss .*check_finite is on"):
        _local_nan_step()
    assert math.isnan(_local_nan_step(check_finite=False))          # switched off: the NaN is let through


def test_check_finite_env_switch():
    code = NAN_STEP + "\nprint('loss', nan_step())"
    off = python("-c", code, env={"PDIST_CHECK_FINITE": "0"})
    assert off.returncode == 0 and "loss nan" in off.stdout, off.stderr
    bad = python("-c", code, env={"PDIST_CHECK_FINITE": "maybe"})
    assert bad.returncode != 0 and "PDIST_CHECK_FINITE='maybe': expected one of" in bad.stderr


def test_ddp_nan_on_one_rank_stops_every_rank_by_default(request):
    for r, rep in shared(request, "ddp").items():
        assert rep["error"] and rep["error"].startswith("step 1: non-finite loss on rank(s) [1]"), (r, rep)
        assert rep["steps_done"] == 1
    off = shared(request, "ddp_off")                                     # switched off: the old silence
    assert all(rep["error"] is None and not rep["last_loss_finite"] for rep in off.values()), off


# ------------------------------------------------------------------ 4. fp16's skipped steps
def test_fp16_skips_are_counted_and_k_in_a_row_stop_every_rank(request):
    for r, rep in shared(request, "fp16").items():
        assert rep["error"] and rep["error"].startswith(
            "GradScaler: 5 steps in a row skipped (non-finite gradients at every loss scale from 65536 down to 4096; "
            "5 skipped in all)"), (r, rep)
        assert rep["skipped"] == 5 and rep["steps_done"] == 6     # step 0 trained, steps 1-5 skipped
    assert shared(request).count("[GradScaler] skipped a step") == 2 * 4   # verbose (this job only): per skip, rank


def test_fp16_default_stops_after_100_skips_and_counts_recoveries():
    from pdist.engine.grad_scaler import GradScaler
    from pdist.errors import NonFiniteError
    s = GradScaler()
    s.record(True)
    s.update()
    s.record(False)
    s.update()
    assert (s.skipped, s.skipped_in_a_row, s.get_scale()) == (1, 0, 2.0 ** 15)
    for _ in range(99):
        s.record(True)
        s.update()
    with pytest.raises(NonFiniteError, match="100 steps in a row skipped .* 101 skipped in all"):
        s.record(True)
        s.update()
    with pytest.raises(ValueError, match="max_consecutive_skips must be a positive integer or None"):
        GradScaler(max_consecutive_skips=0)


# ------------------------------------------------------------------ 5. environment variables
@pytest.mark.parametrize("var,value,message", [
    ("PDIST_TIMEOUT", v, f"PDIST_TIMEOUT='{v}': must be a positive number of seconds, e.g. PDIST_TIMEOUT=120")
    for v in ("abc", "nan", "0", "-1", "inf")] + [
    ("PDIST_TRACE_MAX", "abc", "PDIST_TRACE_MAX='abc': must be a positive integer (events kept), e.g. "
                               "PDIST_TRACE_MAX=200000"),
    ("PDIST_WAIT_YIELD_US", "abc", "PDIST_WAIT_YIELD_US='abc': must be a non-negative number of microseconds, "
                                   "e.g. PDIST_WAIT_YIELD_US=1000"),
    ("PDIST_FLIGHT_RECORDER", "-3", "PDIST_FLIGHT_RECORDER='-3': must be a non-negative integer (calls kept; 0: off)")])
def test_environment_variables_are_validated_by_name(var, value, message):
    res = python("-c", "from pdist import comm; comm.init()", env={var: value})
    assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]


def test_bad_timeout_stops_every_rank_at_init(tmp_path):
    script = tmp_path / "init.py"
    script.write_text("from pdist import comm\ncomm.init()\nprint('trained', flush=True)\n")
    res = job(2, script, {"PDIST_TIMEOUT": "nan"}, tmp_path)
    assert res.rc != 0 and "trained" not in res.out, res.out[-2000:]
    msg = "ValueError: PDIST_TIMEOUT='nan': must be a positive number of seconds, e.g. PDIST_TIMEOUT=120"
    assert res.out.count(msg) == 2, res.out[-2000:]         # both ranks


def test_topology_rejects_zero_and_negative_links():
    from pdist.comm import topology
    for spec, what in [("nodes=1x2,inter=0GB/s:10us", "bandwidth '0'"), ("nodes=1x2,intra=-1GB/s:2us", "bandwidth '-1'"),
                       ("nodes=1x2,inter=1GB/s:0us", "latency '0'"), ("nodes=1x2,scale=0", "scale '0'")]:
        with pytest.raises(ValueError, match=f"{what} must be a positive number"):
            topology.Topology(spec)


# ------------------------------------------------------------------ 5. flags
def test_inject_of_a_rank_that_does_not_exist_is_a_usage_error_on_every_rank(request):
    for r, rep in shared(request, "inject").items():                 # exit 2, before any work
        assert rep["code"] == 2 and (f"usage error (rank {r}): --inject 'nan:rank=5,step=1': rank 5 does not "
                                     f"exist: this job has 2 rank(s), 0..1") in rep["out"], rep
        assert "PASS" not in rep["out"] and "==" not in rep["out"], rep


@pytest.mark.parametrize("spec,message", [
    ("nan:rank=0,step=30", "step 30 does not exist: this run trains steps 0..1 (--steps 2"),
    ("slow-link:ranks=0-1,gbps=0", "gbps=0.0 must be > 0 Gbit/s"),
    ("straggler:rank=0,slowdown=nan", "slowdown must be a finite number")])
def test_inject_that_cannot_fire_is_a_usage_error_before_any_work(spec, message):
    res = python(str(LESSONS / "02_data_parallel.py"), "--steps", "2", "--inject", spec)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_inject_nan_under_low_precision(precision):
    """bf16: check_finite names the tensor; fp16: the step is skipped and counted (no StopIteration)."""
    from pdist import comm, data
    from pdist.course import lesson
    from pdist.errors import NonFiniteError
    from pdist.faults import inject
    from pdist.models.gpt import GPT
    from pdist.parallel import parallelize
    from pdist.training import train
    tokens, tok = data.char_dataset(20_000)
    cfg = lesson.gpt_config(tok.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=8)
    m = parallelize(GPT(cfg, 0), comm.DeviceMesh(dp=1), precision=precision)
    inject.set("nan:rank=0,step=1")
    try:
        if precision == "bf16":
            with pytest.raises(NonFiniteError, match="step 1: non-finite gradients of 1 tensor"):
                train(m, lesson.make_adamw(m.parameters()), data.batch_fn(tokens, 4, 8, 0), 3)
        else:
            train(m, lesson.make_adamw(m.parameters()), data.batch_fn(tokens, 4, 8, 0), 3)
            assert m.scaler.skipped == 1 and m.scaler.skipped_in_a_row == 0
    finally:
        inject.clear()


@pytest.mark.parametrize("script", ["00_autograd.py", "01_collectives.py", "08_when_it_breaks.py", "12_two_nodes.py"])
def test_lessons_that_cannot_inject_say_so(script):
    res = python(str(LESSONS / script), "--inject", "nan:rank=0,step=1")
    assert res.returncode == 2 and f"--inject nan:rank=0,step=1: lesson {script[:2]}" in res.stderr, res.stderr[-2000:]
    assert "lessons/02_data_parallel.py --inject" in res.stderr


@pytest.mark.parametrize("script,flags,message", [
    ("00_autograd.py", ["--trace", "/nonexistent-dir/t.json"], "--trace /nonexistent-dir/t.json: directory"),
    ("01_collectives.py", ["--trace", "/nonexistent-dir/t.json"], "--trace /nonexistent-dir/t.json: directory"),
    ("00_autograd.py", ["--json", "/nonexistent-dir/o.json"], "--json /nonexistent-dir/o.json: directory"),
    ("07_checkpoint.py", ["--dir", "/nonexistent-dir/ckpt"], "--dir /nonexistent-dir/ckpt: its parent directory"),
    ("07_checkpoint.py", ["--dir", str(ROOT / "setup.cfg")], "exists and is not a directory"),
    ("12_two_nodes.py", ["--json", "/nonexistent-dir/o.json"], "--json /nonexistent-dir/o.json: directory"),
    ("12_two_nodes.py", ["--link-gbps", "fast"], "--link-gbps 'fast': comma-separated numbers"),
    ("12_two_nodes.py", ["--link-gbps", "1,-2"], "--link-gbps '1,-2': give one or more limits >= 0")])
def test_output_paths_are_checked_before_any_work(script, flags, message):
    res = python(str(LESSONS / script), *flags, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr[-2000:]
    assert res.stdout == "", res.stdout[-2000:]          # nothing trained, timed or printed first
