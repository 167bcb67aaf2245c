"""A simulated cluster: ranks placed on nodes, every collective charged the
alpha-beta time of the slowest link its group crosses.

    PDIST_TOPOLOGY="nodes=2x2,intra=300GB/s:2us,inter=12.5GB/s:10us" mpirun -n 4 python ...
    comm.DeviceMesh(dp=2, tp=2, topology="nodes=2x2,inter=25MB/s:50us")
    topology.set(None)                                   # back to the plain transport

Spec (comma-separated ``key=value``):

    nodes=AxB           A nodes of B ranks, world rank r on node r // B (block placement);
    nodes=0+2/1+3       or explicit nodes, '/' between nodes, '+' between ranks
    intra=BW:LAT        the link inside a node (default 300GB/s:2us, NVLink-like)
    inter=BW:LAT        the link between nodes (default 12.5GB/s:10us, 100 Gb/s InfiniBand)
    scale=S             multiply every charged time by S (default 1)

BW in GB/s, MB/s, Gbps or Mbps (1 GB = 1e9 bytes); LAT in ns, us or ms.

The model. A collective on a group of n ranks sends, per rank, the ring accounting's
bytes (``ProcessGroup.stats``, docs/design.md: all-reduce 2(n-1)/n S, ...) in k ring
steps (all-reduce 2(n-1), the others n-1, send/recv 1). Its link is the slowest one the
group crosses: ``intra`` when every member is on one node, else ``inter``, else a slow
link (``--inject slow-link:ranks=A-B,gbps=G``) when the group holds both A and B.
Charged time = k * alpha + bytes / beta. The transport adds it as a sleep:

* a blocking collective (or send/recv): after the real transfer, the whole charge;
* an async collective: at ``wait()``, whatever is left of the charge counted from
  issue, so compute between issue and wait hides it (DDP's bucket overlap survives).

How faithful. No contention: two groups crossing the same link at the same time each
get the full bandwidth; no topology-aware algorithm (a hierarchical all-reduce would
cross the slow link with 1/B of the bytes); the real transfer (shared memory) is added
on top of the charge, which at these sizes is small against it. The byte counts do not
change; only the timings do. Every rank of a group charges the same time, so they leave
the collective together, as on a real ring. The charged time is its own trace category
(``link``) and is summed per process (``LINK[0]``) and per group (``group._link_s``).

Cost when no topology is set: one attribute check (``group._link is None``) per call.
"""
import math
import os
import re
import time

from pdist.measure import trace

LINK = [0.0]              # seconds of simulated link time charged on this process
DEFAULT_INTRA, DEFAULT_INTER = "300GB/s:2us", "12.5GB/s:10us"
_state = {"topo": None, "env": False, "slow": []}

_BW = {"gb/s": 1e9, "mb/s": 1e6, "gbps": 1e9 / 8, "gbit/s": 1e9 / 8, "mbps": 1e6 / 8}
_LAT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class Link:
    """One link: ``bw`` bytes/s, ``alpha`` seconds per message, ``name``."""
    __slots__ = ("name", "bw", "alpha", "scale")

    def __init__(self, name, bw, alpha, scale=1.0):
        self.name, self.bw, self.alpha, self.scale = name, float(bw), float(alpha), float(scale)

    def seconds(self, op, n, nbytes):
        """alpha-beta time of ``op`` on a group of ``n`` moving ``nbytes`` per rank."""
        k = ring_steps(op, n)
        return self.scale * (k * self.alpha + nbytes / self.bw) if k else 0.0

    def __repr__(self):
        return f"<Link {self.name} {self.bw / 1e9:g} GB/s {self.alpha * 1e6:g} us>"


def ring_steps(op, n):
    """Messages in sequence per rank: all_reduce 2(n-1); the other collectives n-1;
    send/recv 1 (a group of one sends nothing)."""
    if op in ("send", "recv", "isend", "irecv"):
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def parse_link(text, name):
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]+)\s*:\s*([0-9.eE+-]+)\s*([a-z]+)\s*", text)
    if not m or m.group(2).lower() not in _BW or m.group(4) not in _LAT:
        raise ValueError(f"topology {name}={text!r}: expected BW:LAT like 12.5GB/s:10us "
                         f"(BW in {', '.join(_BW)}; LAT in {', '.join(_LAT)})")
    bw, lat = _positive(m.group(1), f"topology {name}={text!r}: bandwidth"), \
        _positive(m.group(3), f"topology {name}={text!r}: latency")
    return Link(name, bw * _BW[m.group(2).lower()], lat * _LAT[m.group(4)])


def _positive(text, label, example="12.5GB/s:10us"):
    """A finite number > 0 (a zero bandwidth divided by zero mid-step; a negative one
    charged negative time), else a ValueError naming the spec."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{label} {text!r} must be a positive number, e.g. {example}")
    return v


class Topology:
    """Ranks on nodes and the two links (see the module doc for the spec)."""

    def __init__(self, spec):
        kv = {}
        for item in (i.strip() for i in spec.split(",") if i.strip()):
            k, eq, v = item.partition("=")
            if not eq or k not in ("nodes", "intra", "inter", "scale"):
                raise ValueError(f"topology {spec!r}: {item!r} is not one of nodes=, intra=, inter=, scale=")
            kv[k] = v.strip()
        if "nodes" not in kv:
            raise ValueError(f"topology {spec!r}: needs nodes=AxB or nodes=0+1/2+3")
        self.spec, nodes = spec, kv["nodes"]
        m = re.fullmatch(r"(\d+)x(\d+)", nodes)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            self.node = {r: r // b for r in range(a * b)}
        else:
            try:
                self.node = {int(r): i for i, part in enumerate(nodes.split("/")) for r in part.split("+")}
            except ValueError:
                raise ValueError(f"topology {spec!r}: nodes={nodes!r} is neither AxB nor 0+1/2+3") from None
        scale = _positive(kv.get("scale", "1"), f"topology {spec!r}: scale", "scale=1")
        self.intra = parse_link(kv.get("intra", DEFAULT_INTRA), "intra")
        self.inter = parse_link(kv.get("inter", DEFAULT_INTER), "inter")
        self.intra.scale = self.inter.scale = scale

    def link_for(self, ranks):
        """The slowest link a group of these world ranks crosses."""
        missing = [r for r in ranks if r not in self.node]
        if missing:
            raise ValueError(f"topology {self.spec!r} places {len(self.node)} ranks; world rank(s) "
                             f"{missing} are on no node")
        return self.intra if len({self.node[r] for r in ranks}) <= 1 else self.inter

    def nodes(self):
        out = {}
        for r, n in sorted(self.node.items()):
            out.setdefault(n, []).append(r)
        return [out[k] for k in sorted(out)]


def current():
    """The active Topology (PDIST_TOPOLOGY is read on first use), or None."""
    if not _state["env"]:
        _state["env"] = True
        spec = os.environ.get("PDIST_TOPOLOGY", "").strip()
        if spec and _state["topo"] is None:
            _state["topo"] = Topology(spec)
    return _state["topo"]


def link_for(ranks):
    """The link a group of these world ranks is charged, or None (no simulation)."""
    topo = current()
    link = topo.link_for(ranks) if topo is not None else None
    for (a, b), lk in _state["slow"]:
        if a in ranks and b in ranks and (link is None or lk.bw < link.bw):
            link = lk
    return link


def _attach_all():
    from pdist.comm import watchdog
    for g in watchdog.groups():
        g._link = link_for(g.ranks)


def set(spec):
    """Simulate the cluster ``spec`` (a string, a Topology, or None to stop) from now
    on, for every existing group and every new one. No communication: every rank must
    call it with the same spec (DeviceMesh(topology=...) does)."""
    _state["env"] = True
    _state["topo"] = Topology(spec) if isinstance(spec, str) and spec.strip() else (
        spec if isinstance(spec, Topology) else None)
    _attach_all()
    return _state["topo"]


def set_slow_links(links):
    """[((a, b), gbps, latency_us)]: links between world ranks a and b (pdist.faults.inject)."""
    for (a, b), g, us in links:
        _positive(str(g), f"slow link {a}-{b}: gbps", "gbps=1")
        _positive(str(us), f"slow link {a}-{b}: us", "us=10")
    _state["slow"] = [((a, b), Link(f"slow {a}-{b}", g * 1e9 / 8, us * 1e-6)) for (a, b), g, us in links]
    _attach_all()


def charge(group, op, nbytes, link=None, since=None):
    """Sleep the alpha-beta time of ``op`` (minus the time passed ``since`` issue, for
    an async op) and record it: trace category ``link``, ``LINK[0]``, ``group._link_s``."""
    link = link or group._link
    n = 2 if op in ("send", "recv", "isend", "irecv") else group.size
    t = link.seconds(op, n, nbytes)
    t0 = time.perf_counter()
    left = t if since is None else since + t - t0
    if left > 0:
        time.sleep(left)
        t1 = time.perf_counter()
        LINK[0] += t1 - t0
        group._link_s = getattr(group, "_link_s", 0.0) + t1 - t0
        trace.record(f"link {op}", "link", t0, t1, link=link.name, bytes=int(nbytes), group=group.name,
                     charged_s=t)
    return t


def then_charge(group, op, nbytes, then, async_op):
    """A collective's finishing step with the link charge in front of it."""
    since = time.perf_counter() if async_op else None

    def finish():
        charge(group, op, nbytes, since=since)
        if then is not None:
            then()
    return finish


def predict(groups=None):
    """{group name: (link name, seconds)}: the alpha-beta time of what each group's
    stats counted (calls and ring bytes per op) on its link, no overlap assumed."""
    from pdist.comm import watchdog
    out = {}
    for g in (groups if groups is not None else watchdog.groups()):
        link = getattr(g, "_link", None)
        if link is None:
            continue
        s = sum(link.scale * (st["calls"] * ring_steps(op, 2 if op in ("send", "recv") else g.size) * link.alpha
                              + st["bytes"] / link.bw) for op, st in g.stats.items()
                if ring_steps(op, 2 if op in ("send", "recv") else g.size))
        out[g.name] = (link.name, s)
    return out


__all__ = ["Topology", "Link", "set", "current", "link_for", "set_slow_links", "charge", "predict",
           "ring_steps", "LINK"]
