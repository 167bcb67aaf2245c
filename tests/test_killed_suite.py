"""Killing ``make test`` leaves no process behind, under pytest-xdist too; and its workers
count each job's ranks (tests/conftest.py).

A small suite (one test that launches a 2-rank job which sleeps, through
``pdist.testing.launch``, with this suite's conftest) runs as ``pytest -n 2`` in a
process group of its own. Once the job's ranks are up, the group gets the signal that
``timeout 60 make test`` sends (SIGTERM, to the whole group) or that Ctrl-C sends (SIGINT,
to the foreground group); within a few seconds no process of that run may be left: not
the workers, not mpiexec, not its proxies or ranks. The ranks carry a token of this test
in their arguments, which is how they are found (listed only, never killed by name)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from test_launch_cleanup import like_a_terminal

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("xdist")

INNER = '''
import sys
from pathlib import Path
from pdist.testing import launch

def test_sleeping_job():
    launch(2, Path(__file__).with_name("sleeper.py"), "{token}", timeout=300)
'''
SLEEPER = "import sys, time\nprint('up', sys.argv[1], flush=True)\ntime.sleep(300)\n"


def left(token, group=None):
    """pids (with their command lines) of processes whose arguments hold ``token``, and of
    the processes still in process group ``group`` (the pytest workers)."""
    out = subprocess.run(["pgrep", "-af", token], capture_output=True, text=True).stdout
    if group is not None:
        out += subprocess.run(["pgrep", "-a", "-g", str(group)], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if "pgrep" not in ln]


def wait_for(cond, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["timeout", "ctrl-c"])
def test_killing_the_xdist_suite_leaves_no_process(sig, tmp_path):
    if shutil.which("pgrep") is None:
        pytest.skip("needs pgrep to list processes")
    token = f"pdist-killed-suite-{uuid.uuid4().hex}"
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / f"test_inner_{token.replace('-', '_')}.py").write_text(INNER.format(token=token))
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    suite = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                              str(tmp_path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=like_a_terminal)
    try:
        assert wait_for(lambda: len([ln for ln in left(token) if "sleeper.py" in ln]) >= 2, 90), \
            f"the job's ranks never came up: {left(token)}"
        os.killpg(suite.pid, sig)                 # what timeout(1) and a terminal's Ctrl-C do
        suite.wait(timeout=60)
        assert wait_for(lambda: not left(token, suite.pid), 15), \
            f"left behind after {sig.name}:\n" + "\n".join(left(token, suite.pid))
    finally:                                      # never leave them to the next test
        for ln in left(token, suite.pid):
            try:
                os.kill(int(ln.split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()


POOLED = '''
import json, os, time
from pathlib import Path
from pdist.testing import launch

def _job(i):
    r = launch(2, Path(__file__).with_name("stamp.py"), str(Path(__file__).with_name(f"span{i}.json")))
    assert r.rc == 0, r.out

def test_a():
    assert launch.__name__ == "launch_counted"
    _job(0)

def test_b():
    _job(1)
'''
STAMP = ("import json, os, sys, time\nt0 = time.time(); time.sleep(1.5)\n"
         "if os.environ.get('PMI_RANK', '0') == '0':\n"
         "    open(sys.argv[1], 'w').write(json.dumps([t0, time.time()]))\n")


def test_xdist_workers_count_each_jobs_ranks(tmp_path):
    """Two workers, two tests, each launching a 2-rank job, with a pool of 2 rank units: the
    jobs must run one after the other (with 4 units they could overlap)."""
    (tmp_path / "stamp.py").write_text(STAMP)
    (tmp_path / "test_pooled.py").write_text(POOLED)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    env = dict(os.environ, PDIST_TEST_UNITS="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (a0, a1), (b0, b1) = sorted(json.loads((tmp_path / f"span{i}.json").read_text()) for i in (0, 1))
    assert a1 <= b0, f"the two 2-rank jobs overlapped with 2 units: {a0, a1} and {b0, b1}"
