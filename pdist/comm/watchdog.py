"""Watchdog: every wait has a deadline, and a rank that leaves is noticed at once.

Idea. Every wait in pdist polls (``mpi.wait_all``: Test, then yield or spin)
instead of blocking inside MPI, and every ``PROBE_S`` it calls ``Watch.check``,
which does two cheap things:

* reads the *control channel*, a Dup of COMM_WORLD on which ranks announce
  "I exited after #k", "I failed with X" or "here is my status" (``Iprobe``:
  nothing pending costs a fraction of a microsecond);
* compares the clock with the deadline, ``PDIST_TIMEOUT`` seconds (default
  600, PyTorch's ten minutes; ``comm.init(timeout=S)`` sets a default, the
  environment variable wins).

When the deadline passes, or a rank this wait needs has exited, or any rank
has failed, the rank takes a *roll-call*: it sends its status (the collective
it waits in, the last one it finished on each group) to every rank, collects
theirs for up to ``ROLLCALL_S``, and raises ``CollectiveTimeoutError`` whose
message says which world ranks arrived at the collective and, for each missing
rank, where it is instead: waiting elsewhere, "exited after #k", "failed", or
"no answer", or "dead".

Liveness (liveness.py): every ``LIVENESS_S`` a waiting rank probes its node's peers
(``os.kill(pid, 0)`` on the pids exchanged at ``comm.init()``). A peer that is gone is
"dead": the wait takes the roll-call at once, so a killed rank is named within a second
even where the launcher lets the job run on (``srun --mpi=pmi2`` without ``-K``, Hydra's
``-disable-auto-cleanup``). Ranks on other nodes are not probed. Every rank that waits gets the same roll-call and raises too.

The calls a rank waits in are the flight recorder's entries (flight_recorder.py:
the last 64 calls, the current one, the step stamp).
"""
import time
import weakref

from mpi4py import MPI

from pdist.comm import liveness
from pdist.comm.flight_recorder import _cur, describe

TAG = 7701              # control-channel messages
PROBE_S = 0.002         # how often a waiting rank reads the control channel and the clock
ROLLCALL_S = 1.0        # how long a roll-call waits for the other ranks' answers
GONE = ("exited", "failed", "dead")


class CollectiveTimeoutError(RuntimeError):
    """A collective or point-to-point wait that can never finish: its deadline
    passed (``reason="timeout"``), or a rank it needs exited (``"exited"``) or
    failed (``"failed"``). The message is the group's roll-call."""

    def __init__(self, message, reason="timeout"):
        super().__init__(message)
        self.reason = reason


_S = {"timeout": 600.0, "ctl": None, "rank": 0, "size": 1, "sent": [], "status_sent": False,
      "groups": [], "silent": set(), "live_next": 0.0}
_peers = {}              # world rank -> its latest control message


def configure(timeout=None):
    """Start the watchdog (collective over COMM_WORLD: Dups the control channel).
    ``PDIST_TIMEOUT``, when set, wins over ``timeout``; default 600 s."""
    from pdist.engine.env import check_number, env_number
    env = env_number("PDIST_TIMEOUT", None, "number of seconds", 120)
    if env is not None:
        _S["timeout"] = float(env)
    elif timeout is not None:
        _S["timeout"] = float(check_number(timeout, f"timeout={timeout!r}", "number of seconds", "timeout=120"))
    if _S["ctl"] is None:
        w = MPI.COMM_WORLD
        _S.update(rank=w.Get_rank(), size=w.Get_size(), ctl=w.Dup())


def timeout():
    return _S["timeout"]


def register(group):
    _S["groups"].append(weakref.ref(group))


def groups():
    return [g for g in (r() for r in _S["groups"]) if g is not None]


# ------------------------------------------------------------ liveness
def probe_peers():
    """Mark every node peer whose process is gone as "dead" (liveness.py); True when one is."""
    skip = {r for r, m in _peers.items() if m.get("kind") in GONE}
    for r, pid in liveness.dead(skip).items():
        _peers[r] = {"kind": "dead", "rank": r, "cur": None, "last": {}, "pid": pid,
                     "error": f"dead: its process (pid {pid}) is gone, killed or crashed outside Python"}
    return any(m.get("kind") == "dead" for m in _peers.values())


# ------------------------------------------------------------ control channel
def _lasts():
    """{group key: the last collective this rank finished on it}."""
    out = {}
    for g in groups():
        if g._last is not None:
            out[_key(g.name, g.ranks)] = g._last.as_dict()
    return out


def _key(name, ranks):
    return f"{name}{list(ranks)}"


def announce(kind, error=None):
    """Tell every other rank 'exited', 'failed' or 'status'."""
    ctl = _S["ctl"]
    if ctl is None:
        return
    msg = {"kind": kind, "rank": _S["rank"], "cur": _cur[0].as_dict() if _cur[0] else None,
           "last": _lasts(), "error": error}
    for r in range(_S["size"]):             # everyone: an exited rank still listens until the end
        if r != _S["rank"]:
            _S["sent"].append(ctl.isend(msg, dest=r, tag=TAG))


def drain():
    """Read every pending control message; True when any arrived."""
    ctl, st, got = _S["ctl"], MPI.Status(), False
    while ctl.Iprobe(MPI.ANY_SOURCE, TAG, st):
        msg = ctl.recv(source=st.Get_source(), tag=TAG)
        if _peers.get(msg["rank"], {}).get("kind") not in GONE:
            _peers[msg["rank"]] = msg
        got = True
    return got


def wait_for_peers(limit, until_all_gone=True):
    """Poll until every other rank has exited or failed (or ``limit`` s pass).
    Returns 'clean' (all exited), 'failed' (one failed) or 'timeout'."""
    end = time.perf_counter() + limit
    while True:
        drain()
        kinds = [_peers.get(r, {}).get("kind") for r in range(_S["size"])
                 if r != _S["rank"] and r not in _S["silent"]]     # (no answer to a roll-call: stuck)
        if not until_all_gone and time.perf_counter() >= _S["live_next"]:
            _S["live_next"] = time.perf_counter() + liveness.LIVENESS_S
            probe_peers()
            kinds = [_peers.get(r, {}).get("kind") for r in range(_S["size"])
                     if r != _S["rank"] and r not in _S["silent"]]
        if ("failed" in kinds or "dead" in kinds) and not until_all_gone:
            return "failed"
        if all(k in GONE for k in kinds):
            if "failed" in kinds or "dead" in kinds:
                return "failed"
            if MPI.Request.Testall(_S["sent"]) or time.perf_counter() > end:
                return "clean"                # (our own notices delivered: safe to finalize)
            continue
        if time.perf_counter() > end:
            return "timeout"
        time.sleep(0.001)


def peers():
    return dict(_peers)


# ------------------------------------------------------------------ waiting
class Watch:
    """The deadline and control-channel checks of one wait (made on the slow path only)."""
    __slots__ = ("deadline", "next", "exit_seen")

    def __init__(self, t0):
        self.deadline, self.next, self.exit_seen = t0 + _S["timeout"], t0 + PROBE_S, None

    def check(self, t):
        """Raise CollectiveTimeoutError if this wait can never finish."""
        self.next = t + PROBE_S
        if t >= _S["live_next"]:
            _S["live_next"] = t + liveness.LIVENESS_S
            probe_peers()
        if _S["ctl"] is not None and (drain() or _peers):
            reason = self._blocked(t)
            if reason:
                raise rollcall(reason)
        if t >= self.deadline:
            raise rollcall("timeout")

    def _blocked(self, t):
        cur = _cur[0]
        kinds = {m.get("kind") for m in _peers.values()}
        if "failed" in kinds:
            return "failed"
        if "dead" in kinds:
            return "dead"
        if "status" in kinds:
            return "rollcall"
        if cur is None:
            return None
        for r, m in _peers.items():          # exited ranks: do we still need them?
            if m["kind"] != "exited" or r not in cur.ranks:
                continue
            if cur.seq:
                last = m["last"].get(_key(cur.group, cur.ranks))
                if last is None or last["seq"] < cur.seq:
                    return "exited"
            elif cur.peer == r:              # point-to-point: data may trail the notice
                self.exit_seen = self.exit_seen or t
                if t - self.exit_seen > 0.25:
                    return "exited"
        return None


def poll(done):
    """Wait until ``done()`` is true, with the deadline and control-channel checks
    (for waits that are not MPI requests, e.g. a CUDA event); yields the core."""
    if done():
        return
    t0 = time.perf_counter()
    watch = Watch(t0)
    while not done():
        t = time.perf_counter()
        if t >= watch.next:
            watch.check(t)
        time.sleep(20e-6)


def rollcall(reason):
    """Exchange statuses with every rank and build the error to raise."""
    if not _S["status_sent"]:
        _S["status_sent"] = True
        announce("status")
    end = time.perf_counter() + min(ROLLCALL_S, max(0.2, _S["timeout"]))
    others = [r for r in range(_S["size"]) if r != _S["rank"]]
    while any(r not in _peers for r in others) and time.perf_counter() < end:
        drain()
        probe_peers()
        time.sleep(0.001)
    _S["silent"] = {r for r in others if r not in _peers}
    message, reason = format_rollcall(reason)
    return CollectiveTimeoutError(message, reason)


def _names(ranks, verb=""):
    ranks = sorted(ranks)
    v = f" {verb}{'s' if len(ranks) == 1 else ''}" if verb else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) + v


def format_rollcall(reason):
    """(message, reason): the roll-call (see the module docstring) for this rank's
    current wait; the headline names a failed rank first, else missing ranks that
    exited, else the deadline."""
    me, cur = _S["rank"], _cur[0]
    c = cur.as_dict() if cur else None
    key = _key(cur.group, cur.ranks) if cur else None
    members = list(cur.ranks) if cur else list(range(_S["size"]))
    arrived, lines, exited, failed = [me], [], {}, []
    for r in members:
        if r == me:
            continue
        m = _peers.get(r)
        last = (m or {}).get("last", {}).get(key) if key else None
        after = f"after {describe(last)}" if last else f"before any collective on group '{c['group']}'" if c else ""
        if m is None:
            lines.append(f"  rank {r}: no answer (busy outside pdist's collectives, or stuck)")
        elif m["kind"] == "exited":
            exited.setdefault(after, []).append(r)
            lines.append(f"  rank {r}: exited {after}")
        elif m["kind"] == "failed":
            failed.append(r)
            lines.append(f"  rank {r}: failed: {m['error']}")
        elif m["kind"] == "dead":
            lines.append(f"  rank {r}: {m['error']}")
        elif c and c["seq"] and m["cur"] and m["cur"]["seq"] == c["seq"] and \
                _key(m["cur"]["group"], m["cur"]["ranks"]) == key:
            arrived.append(r)
        else:
            lines.append(f"  rank {r}: waits in {describe(m['cur'])}; last here: {describe(last) if last else 'none'}")
    where = describe(c)
    if c and c["seq"]:
        where += f" (size={c['size']}, {c['dtype']}, step {c['step']})" if c["dtype"] else f" (step {c['step']})"
    wait = f"{_names(arrived, 'wait')} in {where}"
    bad = sorted(r for r, m in _peers.items() if m["kind"] == "failed")
    dead = sorted(r for r, m in _peers.items() if m["kind"] == "dead")
    if bad:
        reason = "failed"
        head = f"{_names(bad)} failed ({_peers[bad[0]]['error']}); {wait}"
    elif dead:
        reason = "dead"
        head = (f"{_names(dead)} {'is' if len(dead) == 1 else 'are'} dead (pid {_peers[dead[0]]['pid']} is gone: "
                f"killed, or crashed outside Python); {wait}")
    elif exited:
        reason = "exited"
        head = "; ".join(f"{_names(rs)} exited {a}" for a, rs in exited.items()) + f"; {wait}"
    else:
        reason = "timeout"
        head = f"{where} did not complete within {_S['timeout']:g} s (PDIST_TIMEOUT); {wait}"
    body = [f"roll-call of group '{c['group'] if c else 'world'}' (world ranks {members}):",
            f"  arrived: {', '.join(map(str, sorted(arrived)))}"] + lines
    return head + "\n" + "\n".join(body), reason
