"""A failure on any rank ends the whole job within seconds, the failing rank named.

Without this, MPI leaves a job hanging: a rank that raises enters
``MPI_Finalize`` at exit and waits there for ranks that wait for it in a
collective. ``comm.init()`` installs three hooks (only when the world has more
than one rank):

* ``sys.excepthook``: an uncaught exception (KeyboardInterrupt included)
  prints the traceback, each line tagged ``[rank r]``, between
  ``[pdist rank r FAILED]`` and ``[pdist rank r END]``, dumps the flight
  recorder (flight_recorder.py), announces "failed" on the control channel
  (watchdog.py), waits up to ``GRACE_S`` for the other ranks to print their
  own errors (ranks waiting in a collective see the announcement and raise at
  once), then calls ``MPI_Abort``, which ends every rank with a non-zero exit.
* SIGINT and SIGTERM: the first one raises KeyboardInterrupt where the rank is
  (waits poll, so that is soon; inside a collective, once it is over, at most
  ``DEFER_S`` later, so that no peer is left in its data phase without a report), so every rank prints its report and writes its
  flight recorder within ``GRACE_S``; a second one (either) aborts at once.
  SIGTERM is what a cluster sends: Open MPI's ``mpirun`` does not forward Ctrl-C,
  it sends SIGCONT then SIGTERM to every rank (then SIGKILL); Slurm's ``scancel``
  and time limits send SIGTERM, then SIGKILL after ``KillWait`` (30 s default).
* ``atexit``: a rank that exits (``sys.exit(0)`` included) announces "exited
  after #k" and waits for the others. If all of them exit too, the job ends
  cleanly (exit 0). If one fails instead (e.g. it was waiting for this rank in
  a collective and raised), the job is aborted. An async op never waited on
  is reported here too.

This mirrors ``python -m mpi4py``'s run mode (abort on an uncaught exception)
but works under plain ``mpirun python script.py`` and lets every rank print its
own error first. A dead rank (SIGKILL) needs nothing: the MPI launcher ends
the job at once; where it does not (``srun`` without ``-K``), the ranks that wait
find it "dead" by its pid within a second (liveness.py).
"""
import atexit
import os
import signal
import sys
import time
import traceback

from mpi4py import MPI

from pdist.comm import flight_recorder, watchdog

GRACE_S = 2.0          # how long a failing rank waits for the others to print before aborting
FLUSH_S = 0.2          # then lets the launcher forward their output (Open MPI's under load needs > 0.05 s)
DEFER_S = 0.5          # the longest a signal waits for the call it came in to finish (``_defer``)
ALARM_S = 0.02         # how often a deferred signal looks for the end of that call

_state = {"installed": False, "ending": False, "sigint": 0, "hook": None, "signal": None}


def install():
    """Install the three hooks (idempotent; nothing for a world of one)."""
    if _state["installed"] or MPI.COMM_WORLD.Get_size() == 1:
        return
    _state["installed"], _state["hook"] = True, sys.excepthook
    sys.excepthook = _excepthook
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_signal)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_signal)
    except ValueError:          # not the main thread: leave signals alone
        pass
    atexit.register(_at_exit)


def installed():
    return _state["installed"]


def _tagged(text):
    r = watchdog._S["rank"]
    return "\n".join(f"[rank {r}] {line}" for line in text.rstrip("\n").splitlines())


def _print_block(text, word="FAILED"):
    r = watchdog._S["rank"]
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.stderr.write(f"[pdist rank {r} {word}]\n{_tagged(text)}\n[pdist rank {r} END]\n")
    sys.stderr.flush()


def fail(text, error_line, reason="exception", word="FAILED"):
    """Print ``text`` as this rank's failure, tell the others, abort the job.
    ``word`` STOPPED marks a rank that only stopped because another one failed."""
    if _state["ending"]:
        os._exit(1)
    _state["ending"] = True
    path = flight_recorder.dump(reason, watchdog._S["rank"], watchdog.timeout())
    _print_block(text + f"\nflight recorder: {path}", word)
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        watchdog.announce("failed", error=error_line)
        watchdog.wait_for_peers(GRACE_S)
        time.sleep(FLUSH_S)                   # let the launcher forward the output
        MPI.COMM_WORLD.Abort(1)
    os._exit(1)


def fail_exception(exc_type, exc, tb):
    """The failure of an uncaught exception (used by excepthook and pdist.testing)."""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    first = f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    cur = flight_recorder._cur[0]
    if cur is not None:
        first += f" (in {flight_recorder.describe(cur.as_dict())})"
    sig = (exc.args[0] if exc is not None and exc.args else "SIGINT") if exc_type is KeyboardInterrupt else None
    if sig:
        first = f"KeyboardInterrupt ({sig})"
    stopped = isinstance(exc, watchdog.CollectiveTimeoutError) and exc.reason == "failed"
    if stopped and not sig and _state["signal"]:   # this rank's own signal, deferred, was overtaken by
        sig = _state["signal"]                     # a peer's stop (the same signal, there first)
    fail(text, first, sig.lower() if sig else "exception", "STOPPED" if stopped else "FAILED")


def _excepthook(exc_type, exc, tb):
    fail_exception(exc_type, exc, tb)


def _on_signal(signum, frame):
    """SIGINT or SIGTERM: the first raises KeyboardInterrupt (its args name the signal), at once
    outside pdist's calls; inside one, once it is over (``_defer``); a second one aborts."""
    _state["sigint"] += 1
    name = signal.Signals(signum).name
    _state["signal"] = _state["signal"] or name
    if _state["ending"] and _state["sigint"] == 1:   # already reporting a failure: let it finish
        return
    if _state["sigint"] > 1:                  # a second Ctrl-C (or SIGTERM): no more waiting
        fail(f"second signal ({name}): aborting now", f"KeyboardInterrupt (second signal, {name})", name.lower())
    if signum == signal.SIGTERM:              # the launcher's SIGKILL may follow soon (Open MPI 5: 0.25 s):
        flight_recorder.dump("sigterm", watchdog._S["rank"], watchdog.timeout())   # write the recorder first
    if flight_recorder._cur[0] is not None and _defer(name):
        return
    _raise(name)


def _raise(name):
    raise KeyboardInterrupt(name) if name != "SIGINT" else KeyboardInterrupt


def _defer(name):
    """Inside a call, peers may already be past its check and in the data phase (a blocking MPI
    call that cannot see this rank leave): finish the call first, then raise, at the next call's
    start (flight_recorder.ON_ENTER) or at a SIGALRM tick (every ALARM_S) outside any call, at the
    latest after DEFER_S. False where SIGALRM cannot be used (the signal is raised at once)."""
    try:
        _state["alarm"] = signal.signal(signal.SIGALRM, lambda s, f: _deferred())
        signal.setitimer(signal.ITIMER_REAL, ALARM_S, ALARM_S)
    except (ValueError, OSError):
        return False
    _state["deferred"] = (name, time.monotonic())
    flight_recorder.ON_ENTER.append(_deferred_at_enter)
    return True


def _deferred_at_enter():
    _deferred(force=True)


def _deferred(force=False):
    d = _state.get("deferred")
    if d is None or not (force or flight_recorder._cur[0] is None or time.monotonic() - d[1] > DEFER_S):
        return
    _state["deferred"] = None
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, _state.pop("alarm", signal.SIG_DFL) or signal.SIG_DFL)
    if _deferred_at_enter in flight_recorder.ON_ENTER:
        flight_recorder.ON_ENTER.remove(_deferred_at_enter)
    _raise(d[0])


def unwaited():
    """Descriptions of async ops issued on this rank and never waited on."""
    out = []
    for g in watchdog.groups():
        for p in g._pending:
            if not p.waited:
                out.append(f"async {flight_recorder.describe(p.entry.as_dict())} was never waited on")
    return out


def _at_exit():
    if _state["ending"] or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    left = unwaited()
    if left:
        fail("\n".join(left) + "\n(call .wait() on every Work an async_op=True call returns)",
             left[0], "unwaited")
    flight_recorder._cur[0] = None
    watchdog.announce("exited")
    outcome = watchdog.wait_for_peers(max(watchdog.timeout(), GRACE_S), until_all_gone=False)
    if outcome == "clean":
        return
    _state["ending"] = True
    peers = watchdog.peers()
    bad = sorted(r for r, m in peers.items() if m["kind"] in ("failed", "dead"))
    last = [f"{flight_recorder.describe(e)}" for e in watchdog._lasts().values()]
    why = (f"rank(s) {bad} failed while this rank had already exited" if bad else
           f"other ranks were still running {watchdog.timeout():g} s (PDIST_TIMEOUT) after this rank exited")
    _print_block(f"this rank exited (last: {', '.join(last) or 'no collective'}) but the job did not "
                 f"end cleanly: {why}; aborting the job")
    watchdog.wait_for_peers(GRACE_S)          # let the failing ranks print their errors
    time.sleep(FLUSH_S)
    MPI.COMM_WORLD.Abort(1)
