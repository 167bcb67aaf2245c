"""Is a peer's process still there? ``os.kill(pid, 0)`` on the ranks of this node.

``comm.init()`` exchanges every rank's pid and pid namespace over the node's split
(``mpi.node_exchange``) and hands the peers that share this process's pid namespace to
``set_node_pids``: only those pids mean the same process here. ``dead(skip)`` returns the
ones whose process is gone (no such pid, or a zombie: it died and its parent has not reaped
it yet). The watchdog (watchdog.py) probes every ``LIVENESS_S`` while a rank waits, so a
rank killed where the launcher lets the job run on is named "dead" within a second instead
of "no answer" at the deadline. Ranks on other nodes are never probed (a pid there means
nothing here): they are found by the deadline, or by the launcher.
"""
import os

LIVENESS_S = 0.2        # how often a waiting rank probes its node's peers
_pids = {}              # world rank -> pid, for this node's peers in this pid namespace


def set_node_pids(pids):
    _pids.clear()
    _pids.update(pids)


def node_pids():
    return dict(_pids)


def alive(pid):
    """False when ``pid`` is gone or a zombie; True otherwise (also where /proc is missing)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):   # gone (PermissionError: the pid is someone else's now)
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def dead(skip=()):
    """{world rank: pid} of the node's peers (not in ``skip``) whose process is gone."""
    return {r: pid for r, pid in _pids.items() if r not in skip and not alive(pid)}


__all__ = ["alive", "dead", "set_node_pids", "node_pids", "LIVENESS_S"]
