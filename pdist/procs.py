"""Process trees that always end: bounded output capture, reaping by marker, and the
launches a dying caller takes down with it (used by ``pdist.testing.launch``). Contract:

* ``Capture(pipe, max_output)`` reads a pipe in a thread and keeps at most
  ``max_output`` bytes: the first half and the last half, with one line in between
  saying how many bytes were dropped. ``None`` keeps everything.
* Every launch puts ``PDIST_LAUNCH_MARK=<random>`` in its environment. Every process
  it starts inherits it, including children that call ``setsid()`` (leaving the process
  group does not change the environment). ``kill_marked(mark)`` SIGKILLs every process whose
  ``/proc/<pid>/environ`` holds that marker, until none is left.
* ``child_subreaper()`` makes this process the one that orphans of its descendants are
  reparented to (``PR_SET_CHILD_SUBREAPER``), so a process that also scrubbed its
  environment is still found: ``kill_orphans(keep)`` kills and reaps every child of
  this process that is not one of ``keep`` (the launches' own ``mpiexec``).
* ``track(proc, mark)`` registers a live launch; on SIGTERM, SIGINT or SIGHUP every
  live launch's process group and marked processes are killed, then the signal takes its
  previous course (``install_signal_cleanup``); ``kill_all_live(stop_new=True)`` also kills
  every launch tracked after it. ``die_with_parent`` (a ``preexec_fn``, or ``setpriv`` where
  threads run: ``die_with_parent_how``) has the kernel SIGKILL the child when its parent
  thread dies (``PR_SET_PDEATHSIG``), for a parent SIGKILLed before any handler runs.
Linux only for the /proc and prctl parts; elsewhere they do nothing.
"""
import collections
import ctypes
import os
import select
import shutil
import signal
import subprocess
import threading
import time

MARK_VAR = "PDIST_LAUNCH_MARK"
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


class Capture:
    """Read ``pipe`` (a binary file) to its end in a daemon thread, keeping at most
    ``max_output`` bytes (first half + last half); ``text()`` decodes it (UTF-8,
    undecodable bytes replaced)."""

    def __init__(self, pipe, max_output=None):
        if max_output is not None and max_output < 2:
            raise ValueError(f"max_output={max_output!r}: give None (keep all) or a byte count >= 2")
        self.pipe, self.limit = pipe, max_output
        self.head, self.tail, self.tail_len, self.dropped = bytearray(), collections.deque(), 0, 0
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        signals_to_main_thread()
        fd, poll = self.pipe.fileno(), select.poll()
        poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while not self.stop:
            if not poll.poll(100):               # wake up now and then to see ``stop``
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            self._keep(chunk)

    def _keep(self, chunk):
        if self.limit is None:
            self.head += chunk
            return
        half = self.limit // 2
        room = half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail.append(chunk)
            self.tail_len += len(chunk)
            while self.tail_len - len(self.tail[0]) >= self.limit - half:
                self.tail_len -= len(self.tail[0])
                self.dropped += len(self.tail.popleft())

    def finish(self, grace=1.0):
        """Wait up to ``grace`` s for the end of the output, then stop reading (a process
        that escaped every kill may still hold the pipe: it gets EPIPE)."""
        self.thread.join(grace)
        self.stop = True
        self.thread.join()
        self.pipe.close()
        return self.text()

    def text(self):
        tail, dropped = b"".join(self.tail), self.dropped
        if self.limit is not None and len(tail) > self.limit - self.limit // 2:
            cut = len(tail) - (self.limit - self.limit // 2)
            tail, dropped = tail[cut:], dropped + cut
        note = (f"\n[... {dropped} bytes of output dropped (max_output={self.limit}) ...]\n".encode()
                if dropped else b"")
        return (bytes(self.head) + note + tail).decode("utf-8", errors="replace")


def marked(mark):
    """PIDs of the live processes whose initial environment holds ``MARK_VAR=mark``."""
    want, found = f"{MARK_VAR}={mark}".encode(), []
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - no /proc
        return found
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:                      # gone, or not ours
            continue
        if want in env.split(b"\0"):
            found.append(int(name))
    return found


def kill_until_quiet(find, within=3.0):
    """SIGKILL the pids ``find()`` returns until it twice finds none (or ``within`` s); the killed."""
    end, killed, quiet = time.monotonic() + within, set(), 0
    while time.monotonic() < end and quiet < 2:
        pids = find()
        quiet = quiet + 1 if not pids else 0
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except ProcessLookupError:
                pass
        time.sleep(0.02 if pids else 0.01)
    return killed


def kill_marked(mark, within=3.0):
    """How many live processes marked ``mark`` were SIGKILLed (kill_until_quiet)."""
    return len(kill_until_quiet(lambda: [p for p in marked(mark) if _state(p) not in ("Z", "X", None)], within))


def _stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    return s[s.rfind(")") + 2:].split()


def _state(pid):
    return (_stat(pid) or [None])[0]


_SUBREAPER = [False]


def child_subreaper(on=True):
    """Make this process (``on``) the reaper of its descendants' orphans; False where
    the kernel refuses or this is not Linux."""
    _SUBREAPER[0] = bool(_prctl) and _prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0 and on
    return _SUBREAPER[0]


def spawning():
    """Hold this while starting a launch and ``track``-ing it, so that ``kill_orphans``
    (which holds it too) never takes a launch being born for an orphan."""
    return _LOCK


def kill_orphans(keep=()):
    """SIGKILL and reap every child of this process that is neither a live launch nor in
    ``keep``: with ``child_subreaper()`` on, those are descendants of ended launches
    that were reparented here. Returns their PIDs; does nothing (returns []) in a process
    that did not call ``child_subreaper()``, whose other children are not ours to kill."""
    if not _SUBREAPER[0]:
        return []
    with _LOCK:
        return _kill_orphans(keep)


def _kill_orphans(keep):
    me, gone = os.getpid(), []
    keep = set(keep) | {p.pid for p, _ in list(_LIVE.values())}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) in keep:
            continue
        s = _stat(name)
        if s and int(s[1]) == me:
            pid = int(name)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            gone.append(pid)
    return gone


def die_with_parent():
    """``preexec_fn``: the kernel SIGKILLs this child when the thread that started it ends."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)


_SIGKILL = int(signal.SIGKILL)
_SETPRIV = shutil.which("setpriv")


def die_with_parent_how():
    """(preexec_fn, command prefix) that give a child ``PR_SET_PDEATHSIG=SIGKILL``: the
    preexec_fn in a single-threaded process; with threads running (where preexec_fn may
    deadlock), util-linux's ``setpriv --pdeathsig KILL`` if it is installed, else nothing."""
    if _prctl is None:
        return None, []
    if threading.active_count() == 1:
        return die_with_parent, []
    return None, ([_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else [])


# ------------------------------------------------------------ live launches and signals
_LIVE, _LOCK, _PREVIOUS = {}, threading.RLock(), {}
_STOPPED = [False]      # kill_all_live(stop_new=True) was called: no launch may start after it
CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def signals_to_main_thread():
    """Called first in a helper thread: block the cleanup signals there. The kernel hands a
    process-directed signal to any thread that does not block it, and Python runs the handler
    only in the main thread, when it next runs bytecode: a SIGINT that lands in a reader thread
    while the main thread sits in waitpid() or a lock would wait for that call to end."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, CLEANUP_SIGNALS)


def track(proc, mark):
    with _LOCK:
        _LIVE[proc.pid] = (proc, mark)
        if _STOPPED[0]:                # started by a thread as the pool stopped: it must not outlive the stop
            kill_group(proc.pid)


def untrack(proc):
    with _LOCK:
        _LIVE.pop(proc.pid, None)


def wait_interruptibly(proc, timeout=None, step=0.2):
    """``proc.wait(timeout)`` in slices of ``step`` s: a signal handler (Ctrl-C) runs within
    ``step`` even when the signal landed in another thread (TimeoutExpired as proc.wait)."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        left = step if end is None else min(step, end - time.monotonic())
        try:
            return proc.wait(timeout=max(left, 0.001))
        except subprocess.TimeoutExpired:
            if end is not None and time.monotonic() >= end:
                raise


def kill_group(pid, sig=signal.SIGKILL):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all_live(stop_new=False):
    """SIGKILL every live launch (its group, then its marker); ``stop_new``: and any tracked later."""
    with _LOCK:
        _STOPPED[0] = _STOPPED[0] or stop_new
        live = list(_LIVE.values())
    for proc, _ in live:
        kill_group(proc.pid)
    for _, mark in live:
        kill_marked(mark, within=1.0)


def install_signal_cleanup():
    """From the main thread, once: on SIGTERM/SIGINT/SIGHUP kill every live launch, then
    hand the signal to the handler that was there before (re-raised with the default
    action when that was SIG_DFL). Signals that were ignored stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in [s for s in CLEANUP_SIGNALS if s not in _PREVIOUS]:
        prev = signal.getsignal(sig)
        if prev is not signal.SIG_IGN and prev is not None:
            _PREVIOUS[sig] = prev
            signal.signal(sig, _on_signal)
    return True


def _on_signal(sig, frame):
    kill_all_live()
    prev = _PREVIOUS.get(sig, signal.SIG_DFL)
    if callable(prev):
        return prev(sig, frame)
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
