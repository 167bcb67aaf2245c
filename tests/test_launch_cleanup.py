"""pdist.testing.launch leaves no process behind (pdist/procs.py): a setsid child found by
the launch's marker, output kept within ``max_output``, and a caller killed by SIGTERM,
SIGINT or SIGKILL (from its main thread or a worker thread) takes its ranks down."""
import os
import random
import resource
import signal
import subprocess
import sys
import time
import uuid

import pytest

from pdist.course import grade
from pdist.testing import launch


def like_a_terminal():
    """preexec_fn: the child starts as a terminal's command does, with SIGINT and SIGTERM at
    their default action and unblocked (a test process may have inherited them ignored or
    blocked, which a child would inherit too)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def procs_with(needle, where="environ"):
    """PIDs (not this one, not zombies) whose /proc/<pid>/<where> holds ``needle`` (bytes)."""
    found = []
    for n in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{n}/{where}", "rb") as f, open(f"/proc/{n}/stat") as st:
                hit, state = needle in f.read(), st.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if hit and state != "Z" and int(n) != os.getpid():
            found.append(int(n))
    return found


def left_after(mark, within=5.0):
    """The processes carrying ``mark`` still there after up to ``within`` s (a test asserts [])."""
    end = time.monotonic() + within
    while procs_with(mark) and time.monotonic() < end:
        time.sleep(0.1)
    return procs_with(mark)


def kill_left(p, mark):
    """A test's cleanup, whatever it asserted: its process, then anything carrying its mark."""
    p.kill()
    for pid in procs_with(mark):
        os.kill(pid, signal.SIGKILL)


def test_launch_bounds_its_output_and_reaps_setsid_children(tmp_path):
    secs = f"{600 + random.random():.6f}"       # a setsid child holding the output pipe: found by launch's marker
    (tmp_path / "w.py").write_text(f"import os, subprocess\nsubprocess.Popen(['sleep', '{secs}'], start_new_session=True)\n"
                                   "b = b'x' * 1023 + b'\\n'\nos.write(1, b'first line\\n')\n"
                                   "for _ in range(200_000): os.write(1, b)\nos.write(1, b'last line\\n')\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run = launch(1, tmp_path / "w.py", timeout=60, wrap=False, max_output=1 << 16)      # prints 200 MB
    assert run.rc == 0 and run.seconds < 50 and procs_with(secs.encode(), "cmdline") == []
    assert len(run.out) < (1 << 16) + 200 and run.out.startswith("first line") and run.out.endswith("last line\n")
    assert "bytes of output dropped (max_output=65536)" in run.out
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000     # KiB
    assert grade.MAX_OUTPUT <= 1 << 20                   # and the grader bounds its jobs


PARENT = """import sys, threading
from pdist import procs
from pdist.testing import launch
procs.install_signal_cleanup()
job = lambda: launch(4, sys.argv[1], timeout=120, wrap=False, env={'PDIST_TEST_TAG': sys.argv[2]})
if sys.argv[3] == "thread":      # as in class mode: the launch in a worker thread
    t = threading.Thread(target=job)
    t.start()
    t.join()
else:
    job()
"""


@pytest.mark.parametrize("sig,how", [(signal.SIGTERM, "main"), (signal.SIGINT, "main"), (signal.SIGKILL, "main"),
                                     (signal.SIGTERM, "thread"), (signal.SIGKILL, "thread")])
def test_a_killed_caller_leaves_no_rank(tmp_path, sig, how):
    """SIGTERM/SIGINT: launch's handler kills the job; SIGKILL: no handler runs, mpiexec dies
    of PR_SET_PDEATHSIG (setpriv's, from a thread) and its proxy then takes the ranks down."""
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "worker.py").write_text("import time\ntime.sleep(120)\n")
    tag = uuid.uuid4().hex
    mark = f"PDIST_TEST_TAG={tag}".encode()
    p = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "worker.py"), tag, how],
                         preexec_fn=like_a_terminal)
    try:
        end = time.monotonic() + 60
        while len(set(procs_with(mark)) & set(procs_with(b"worker.py", "cmdline"))) < 5 and time.monotonic() < end:
            time.sleep(0.2)                      # mpiexec and its 4 ranks
        assert len(procs_with(mark)) >= 5
        p.send_signal(sig)
        p.wait(timeout=30)
        assert left_after(mark) == []
    finally:
        kill_left(p, mark)


def test_ctrl_c_stops_class_mode_at_once(tmp_path):
    """SIGINT to ``--class``: the running launches are killed, no new one starts, nothing is left."""
    tag = uuid.uuid4().hex
    for s in ("a", "b", "c", "d", "e", "f"):
        (tmp_path / "class" / s).mkdir(parents=True)
        (tmp_path / "class" / s / "ex08_one_f_one_b.py").write_text(
            "import time\n\n\ndef one_f_one_b(p, m):\n    time.sleep(1000)\n")
    p = subprocess.Popen([sys.executable, "-m", "pdist.grade", "--class", str(tmp_path / "class"), "08"],
                         env=dict(os.environ, PDIST_TEST_TAG=tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=like_a_terminal)
    mark = f"PDIST_TEST_TAG={tag}".encode()
    try:
        end = time.monotonic() + 60
        while not set(procs_with(mark)) & set(procs_with(b"checks.py", "cmdline")) and time.monotonic() < end:
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=30)
        assert time.monotonic() - t0 < 10 and p.returncode != 0, err
        assert b"[6/6]" not in err, err                  # the queued students were never started
        assert procs_with(mark) == []
    finally:
        kill_left(p, mark)


STOPPED = """
import sys, time
from pdist import procs
from pdist.testing import launch
procs.kill_all_live(stop_new=True)         # the pool was interrupted while a thread was starting this
t0 = time.monotonic()
run = launch(1, sys.argv[1], timeout=60, wrap=False)
print(f"rc={run.rc} after {time.monotonic() - t0:.2f} s")
"""


def test_a_launch_started_after_the_stop_is_killed_at_once(tmp_path):
    """Class mode's Ctrl-C (kill_all_live(stop_new=True)) races a worker thread that has passed
    its 'stopped?' check and is starting a launch: that launch is killed as soon as it is
    tracked, so the interrupted grader never waits for it (it once ran to its cap)."""
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "t.py").write_text(STOPPED)
    out = subprocess.run([sys.executable, str(tmp_path / "t.py"), str(tmp_path / "sleep.py")], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.startswith("rc=-9 after"), out.stdout + out.stderr
    assert float(out.stdout.split()[2]) < 10, out.stdout


ANOTHER_THREAD = """
import signal, subprocess, sys, threading, time
from pdist import procs
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(8)"])
hit = threading.Thread(target=lambda: (time.sleep(0.3), signal.pthread_kill(threading.get_ident(), signal.SIGINT)))
t0 = time.monotonic()
hit.start()
try:
    procs.wait_interruptibly(sleeper)          # no timeout: launch's default
    print("not interrupted")
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - t0:.2f} s")
finally:
    sleeper.kill()
    sleeper.wait()
"""


def test_ctrl_c_that_lands_in_another_thread_is_handled_at_once(tmp_path):
    """The kernel may hand a process-directed SIGINT to any thread; Python runs the handler in
    the main thread only when it runs bytecode. launch's wait (procs.wait_interruptibly) wakes
    every 0.2 s, so a SIGINT taken by another thread still interrupts it at once (a plain
    blocking proc.wait() would sit in waitpid until the job ended, 8 s here)."""
    (tmp_path / "t.py").write_text(ANOTHER_THREAD)
    out = subprocess.run([sys.executable, str(tmp_path / "t.py")], capture_output=True, text=True, timeout=60,
                         preexec_fn=like_a_terminal)
    assert out.stdout.startswith("interrupted after"), out.stdout + out.stderr
    assert float(out.stdout.split()[2]) < 5, out.stdout
