"""The box's state record, and the removal of what a dead run left behind.

Before it makes anything, a run writes ``<STATE_DIR>/<id>.json`` (atomically): the run id, the
harness's pid and its start time (``/proc/<pid>/stat``, field 22: ticks since boot), the
guardian's once it runs, every name it will make (pdist/cluster/netns.py) and its folder
``<STATE_DIR>/<id>/`` (the agent, the hostfile, the nodes' hosts file).

A record is *dead* when neither its harness nor its guardian is alive (a pid that is gone, a
zombie, or now another process: its start time differs). Only then ``reap()`` removes what the record
names: the processes inside and the namespaces named ``pdist-<id>-...`` of that record's own id,
its folder and the record. A record that does not parse, names another id, or whose names do
not carry its id is left alone: nothing is removed that cannot be proved to be the box's.
"""
import json
import os
import re
import shutil
import tempfile

from pdist.cluster import netns

KIND = "pdist-box"
ID = re.compile(r"[0-9a-f]{8}")


def state_dir():
    """/run/pdist-box where /run is writable (tmpfs: gone at reboot, as the namespaces are),
    else pdist-box in the temporary directory."""
    base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, "pdist-box")


def start_time(pid):
    """The start time of ``pid`` in clock ticks since boot, or None when it is gone (a zombie,
    which an init that does not reap may keep, is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rfind(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def alive(pid, start):
    return pid is not None and start is not None and start_time(pid) == start


def write(record):
    """Write the record atomically (a temporary file, then one rename)."""
    d = state_dir()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, record["id"] + ".json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def new_record(run_id, plan):
    me = os.getpid()
    return {"kind": KIND, "id": run_id, "harness": [me, start_time(me)], "guardian": [None, None],
            "plan": plan, "dir": os.path.join(state_dir(), run_id)}


def read(path):
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if proved(rec, os.path.basename(path)[:-len(".json")]) else None


def proved(rec, run_id):
    """True when ``rec`` is a box record of ``run_id`` whose every name carries that id."""
    if not isinstance(rec, dict) or rec.get("kind") != KIND or rec.get("id") != run_id or not ID.fullmatch(run_id):
        return False
    p = rec.get("plan") or {}
    names = p.get("netns", []) + ([p["switch"]] if p.get("switch") else [])
    return (all(isinstance(n, str) and n.startswith(f"pdist-{run_id}-") for n in names)
            and rec.get("dir") == os.path.join(state_dir(), run_id))


def dead(rec):
    return not any(alive(*(rec.get(k) or [None, None])) for k in ("harness", "guardian"))


def remove(rec):
    """Tear down everything ``rec`` names (a proved record): processes, namespaces, folder, record."""
    p = rec["plan"]
    gone = netns.teardown(netns.all_netns(p))
    shutil.rmtree(rec["dir"], ignore_errors=True)
    try:
        os.remove(os.path.join(state_dir(), rec["id"] + ".json"))
    except FileNotFoundError:
        pass
    return gone


def reap():
    """Remove the leftovers of every dead run (module doc); returns {run id: namespaces deleted}."""
    d, out = state_dir(), {}
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json") or not ID.fullmatch(name[:-5]):
            continue
        rec = read(os.path.join(d, name))
        if rec is not None and dead(rec):
            out[rec["id"]] = remove(rec)
    return out
