"""The box's network, made with iproute2: one network namespace per node, the links between
them, a rate limit per link, the kernel's byte counters, and the teardown.

Names carry the run id (8 hex digits), so two boxes never meet and nothing else is touched:

    pdist-<id>-node1 ... pdist-<id>-nodeN   a network namespace per node
    pdist-<id>-switch                       N > 2: the namespace of the switch (a bridge)
    pd-<id>                                 each node's link interface (the same name in every node)
    pd-<id>-<i>, pd-<id>-br                 N > 2: the switch's port to node i, and its bridge

Every interface is created inside a namespace the run made (``ip link add ... netns``), never in
the host's: when the namespaces go, so do the links. Node i has the link-local address
169.254.100.i/24. Two nodes: one veth pair between them. N nodes: a veth pair from each node
to a bridge in the switch namespace.

A limit (``tc ... tbf rate G burst B latency L``) sits on both ends of a link, so each
direction is limited: a node's sending end limits what it sends, the other end (the peer
node, or the switch's port) what it receives. tbf's ``latency`` bounds how long a packet may
wait in the limit's queue (its buffer); it adds no delay of its own (netem, which would, is not
in every kernel).
"""
import json
import os
import subprocess
import time

SUBNET = "169.254.100"
DEFAULT_QUEUE_MS = 50.0


class BoxError(RuntimeError):
    """A command that builds or runs the box failed (the message names it and its error)."""


def sh(cmd, check=True, timeout=30):
    """Run an iproute2 (or other) command; BoxError naming it and its stderr when it fails."""
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BoxError(f"box: {' '.join(cmd)} failed: {e}") from None
    if check and p.returncode != 0:
        raise BoxError(f"box: {' '.join(cmd)} failed (exit {p.returncode}): {p.stderr.strip()[:400]}")
    return p


def plan(run_id, nodes):
    """Every name of a box of ``nodes`` nodes (a dict; the state record keeps it)."""
    return {"id": run_id, "nodes": [f"node{i}" for i in range(1, nodes + 1)],
            "netns": [f"pdist-{run_id}-node{i}" for i in range(1, nodes + 1)],
            "switch": f"pdist-{run_id}-switch" if nodes > 2 else None,
            "link": f"pd-{run_id}", "bridge": f"pd-{run_id}-br" if nodes > 2 else None,
            "ports": [f"pd-{run_id}-{i}" for i in range(1, nodes + 1)] if nodes > 2 else [],
            "address": {f"node{i}": f"{SUBNET}.{i}" for i in range(1, nodes + 1)}}


def all_netns(p):
    return p["netns"] + ([p["switch"]] if p["switch"] else [])


def build(p):
    """Make the namespaces, the links and the addresses of plan ``p``, all up."""
    for ns in all_netns(p):
        sh(["ip", "netns", "add", ns])
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
    link = p["link"]
    if p["switch"] is None:
        a, b = p["netns"]
        sh(["ip", "-n", a, "link", "add", link, "type", "veth", "peer", "name", link, "netns", b])
    else:
        sw, br = p["switch"], p["bridge"]
        sh(["ip", "-n", sw, "link", "add", br, "type", "bridge"])
        sh(["ip", "-n", sw, "link", "set", br, "up"])
        for ns, port in zip(p["netns"], p["ports"]):
            sh(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", link, "netns", ns])
            sh(["ip", "-n", sw, "link", "set", port, "master", br])
            sh(["ip", "-n", sw, "link", "set", port, "up"])
    for node, ns in zip(p["nodes"], p["netns"]):
        sh(["ip", "-n", ns, "addr", "add", p["address"][node] + "/24", "dev", link])
        sh(["ip", "-n", ns, "link", "set", link, "up"])


def limited_ends(p):
    """[(netns, device)]: where a limit goes, so that both directions of every link are limited."""
    ends = [(ns, p["link"]) for ns in p["netns"]]
    return ends + [(p["switch"], port) for port in p["ports"]]


def set_limit(p, gbps=None, queue_ms=None):
    """tbf at ``gbps`` Gbit/s on every end of every link (queue bound ``queue_ms``, default 50);
    ``gbps=None`` removes the limits."""
    for ns, dev in limited_ends(p):
        if gbps is None:
            sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            continue
        rate = gbps * 1e9 / 8                        # bytes/s
        burst = max(64 * 1024, int(rate * 2e-3))     # two ms of the rate: the timer's tick must not cap it
        sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{gbps * 1000:g}mbit", "burst", str(burst),
            "latency", f"{DEFAULT_QUEUE_MS if queue_ms is None else queue_ms:g}ms"])


def counters(p):
    """{node: {"tx": bytes, "rx": bytes}}: each node's link interface, the kernel's counters."""
    out = {}
    for node, ns in zip(p["nodes"], p["netns"]):
        got = json.loads(sh(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", p["link"]]).stdout)
        s = got[0]["stats64"]
        out[node] = {"tx": int(s["tx"]["bytes"]), "rx": int(s["rx"]["bytes"])}
    return out


def existing():
    """The names of the network namespaces on this host (``ip netns list``)."""
    p = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def pids_in(ns):
    p = sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit() and int(x) != os.getpid()]


def kill_inside(names, within=10.0):
    """SIGKILL every process in the namespaces ``names`` (again, while new ones appear); returns
    the pids killed. A process in a node's namespace belongs to the box: mpiexec, the agents, the
    proxies or daemons and the ranks."""
    from pdist.procs import kill_until_quiet
    return sorted(kill_until_quiet(lambda: [pid for ns in names for pid in pids_in(ns)], within))


def teardown(names):
    """Kill every process inside the namespaces ``names`` and delete them (their links go with
    them). Only names that exist are touched; returns the names deleted."""
    names = [n for n in names if n in set(existing())]
    kill_inside(names)
    gone = []
    for ns in names:
        for _ in range(50):                      # a process may still be leaving it
            if sh(["ip", "netns", "del", ns], check=False).returncode == 0 or ns not in existing():
                gone.append(ns)
                break
            time.sleep(0.1)
    return gone
