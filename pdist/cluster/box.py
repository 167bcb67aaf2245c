"""Box: N emulated nodes on this machine, joined by real TCP links, and MPI runs across them.

    from pdist.cluster import Box, available
    ok, why = available()
    with Box(nodes=2, ranks_per_node=2, link_gbps=None, link_latency_ms=None, mpi="mpich") as box:
        r = box.run(["python", "lessons/03_zero.py", "--steps", "3"], env={"X": "1"}, timeout=300)
        r.returncode, r.stdout, r.stderr, r.link    # r.link: {"node1": {"tx": bytes, "rx": bytes}, ...}
        box.set_link(gbps=1.0)                       # change (or remove: gbps=None) the limit between runs

A node is a network namespace with its own hostname, IPC namespace and /dev/shm
(pdist/cluster/netns.py, files.py); mpiexec runs inside node1 and reaches the other nodes
through the agent, as it would through ssh. Every rank's environment has
``PDIST_NODE_LINK``, the name of its node's link interface: its counters are
``/sys/class/net/$PDIST_NODE_LINK/statistics/{tx,rx}_bytes`` inside the node. The nodes share
this machine's cores, which each node's ranks cannot see: where all the ranks outnumber the
cores, the box sets ``PDIST_COOPERATIVE_WAIT=1`` (unless set), so waiting ranks yield the cores.

Nothing outlives the run: a guardian process (guardian.py), detached by setsid, tears the
box down when the harness ends, however it ends; a run that finds a dead run's state record
removes what that record names (state.py). After every ``run`` every process left inside the
nodes is killed.
"""
import os
import secrets
import subprocess
import sys
import time

from pdist.cluster import files, launchers, netns, state
from pdist.cluster.netns import BoxError


class BoxUnavailable(BoxError):
    """No box on this machine (not root, not Linux, no namespaces, no iproute2): one line why."""


def _tool_missing():
    import shutil
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"), ("mount", "util-linux"),
                      ("hostname", "hostname")):
        if not shutil.which(tool):
            return f"no `{tool}` on PATH (install {pkg})"
    return None


def available():
    """(True, "") where a box can be made here, else (False, one line saying why)."""
    if not sys.platform.startswith("linux"):
        return False, f"the box needs Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "the box needs root (it makes network namespaces, veth links and mounts)"
    missing = _tool_missing()
    if missing:
        return False, "the box needs iproute2 and util-linux: " + missing
    probe = ("ip link add pdprobe0 type veth peer name pdprobe1 && ip link set lo up && "
             "mount -t tmpfs tmpfs /dev/shm && hostname pdprobe")
    try:      # a throwaway namespace of each kind: gone when the probe exits, nothing left behind
        p = subprocess.run(["unshare", "-n", "-u", "-i", "-m", "sh", "-c", probe], capture_output=True, text=True,
                           timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"no namespaces here: unshare failed ({e})"
    if p.returncode != 0:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"no namespaces here (network, UTS, IPC, mount, veth): {err}"
    return True, ""


class Result:
    """One ``Box.run``: ``returncode`` (None when it timed out: ``timed_out``), ``stdout``,
    ``stderr`` (None when not captured), ``link`` ({node: {"tx", "rx"}} bytes its link
    interface sent and received during this run, the kernel's counters), ``seconds``."""

    def __init__(self, returncode, stdout, stderr, link, seconds, timed_out=False):
        self.returncode, self.stdout, self.stderr, self.link = returncode, stdout, stderr, link
        self.seconds, self.timed_out = seconds, timed_out


def _check(nodes, ranks_per_node, gbps, queue_ms):
    for name, v, low in (("nodes", nodes, 2), ("ranks_per_node", ranks_per_node, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"Box: {name}={v!r} must be an integer >= {low}")
    if nodes > 200:
        raise ValueError(f"Box: nodes={nodes} must be <= 200 (one 169.254.100.0/24 address per node)")
    _check_link(gbps, queue_ms)


def _check_link(gbps, queue_ms):
    for name, v in (("link_gbps", gbps), ("link_latency_ms", queue_ms)):
        if v is not None and not (isinstance(v, (int, float)) and 0 < v < 1e6):
            raise ValueError(f"Box: {name}={v!r} must be a positive number (or None: no limit)")
    if queue_ms is not None and gbps is None:
        raise ValueError("Box: link_latency_ms needs link_gbps: it is the queue bound of tbf's rate limit "
                         "(give both, e.g. link_gbps=1, link_latency_ms=5)")


class Box:
    """N emulated nodes (module doc). ``python``/``mpiexec``: of one venv (default: found for
    ``mpi``, pdist/cluster/launchers.py); ``mpiexec_args``: more launcher arguments."""

    def __init__(self, nodes=2, ranks_per_node=2, link_gbps=None, link_latency_ms=None, mpi="mpich",
                 python=None, mpiexec=None, mpiexec_args=()):
        _check(nodes, ranks_per_node, link_gbps, link_latency_ms)
        self.nodes, self.ranks_per_node, self.mpi = nodes, ranks_per_node, mpi
        self.gbps, self.queue_ms, self.extra = link_gbps, link_latency_ms, list(mpiexec_args)
        self._want = (python, mpiexec)
        self.id = self.plan = self.files = self._guard = self._pipe = None

    # ------------------------------------------------------------ up and down
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        ok, why = available()
        if not ok:
            raise BoxUnavailable(f"box: {why}")
        self.python, self.mpiexec = launchers.find(self.mpi, *self._want)
        state.reap()
        self.id = secrets.token_hex(4)
        self.plan = netns.plan(self.id, self.nodes)
        rec = state.new_record(self.id, self.plan)
        os.makedirs(rec["dir"], mode=0o755)
        state.write(rec)                           # before anything is made: a dead run is reapable
        self._start_guardian(rec)
        try:
            netns.build(self.plan)
            self.files = files.write_all(self.plan, rec["dir"], self.ranks_per_node, self.mpi)
            if self.gbps is not None:
                netns.set_limit(self.plan, self.gbps, self.queue_ms)
        except BaseException:
            self.close()
            raise
        return self

    def _start_guardian(self, rec):
        r, w = os.pipe()                           # not inheritable: only the guardian holds r
        try:
            self._guard = subprocess.Popen([sys.executable, "-m", "pdist.cluster.guardian", self.id], stdin=r,
                                           stdout=subprocess.DEVNULL, start_new_session=True,
                                           env=dict(os.environ, PYTHONPATH=str(launchers.ROOT) + os.pathsep
                                                    + os.environ.get("PYTHONPATH", "")))
        finally:
            os.close(r)
        self._pipe = w
        rec["guardian"] = [self._guard.pid, state.start_time(self._guard.pid)]
        state.write(rec)

    def close(self, within=60.0):
        """Tear the box down (the guardian does it when its pipe closes) and wait for it."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._guard is not None:
            try:
                self._guard.wait(timeout=within)
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait()
            self._guard = None
        if self.id is not None:                    # whatever the guardian could not (it was killed)
            rec = state.read(os.path.join(state.state_dir(), self.id + ".json"))
            if rec is not None:
                state.remove(rec)

    # ------------------------------------------------------------ use
    def set_link(self, gbps=None, latency_ms=None):
        """Limit every link to ``gbps`` Gbit/s each way (tbf; ``latency_ms``: its queue bound), or
        remove the limit (``gbps=None``). Between runs."""
        _check_link(gbps, latency_ms)
        netns.set_limit(self.plan, gbps, latency_ms)
        self.gbps, self.queue_ms = gbps, latency_ms

    def counters(self):
        """{node: {"tx", "rx"}}: the kernel's byte counters of each node's link interface now."""
        return netns.counters(self.plan)

    def run(self, cmd, env=None, timeout=None, capture=True):
        """Run ``cmd`` under mpiexec on every node, ``ranks_per_node`` ranks each; a Result.
        ``env``: more variables for every rank (None removes one). ``capture=False``: the output
        goes to this process's stdout and stderr."""
        if self.plan is None:
            raise BoxError("box.run: the box is not started (use `with Box(...) as box:` or box.start())")
        from pdist import launcher
        e = dict(os.environ)
        e.update(launcher.nested_env(e))
        for k, v in (env or {}).items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = str(v)
        e = {k: v for k, v in e.items() if v is not None}
        e["PATH"] = os.path.dirname(self.python) + os.pathsep + e.get("PATH", "")
        e["PDIST_NODE_LINK"] = self.plan["link"]
        e.pop("PDIST_LINK_GBPS", None)
        if self.gbps is not None:
            e["PDIST_LINK_GBPS"] = f"{self.gbps:g}"         # the limit, for the planner (pdist/plan/here.py)
        e["PYTHONUNBUFFERED"] = "1"
        if self.nodes * self.ranks_per_node > len(os.sched_getaffinity(0)):
            e.setdefault("PDIST_COOPERATIVE_WAIT", "1")    # the nodes share these cores (pdist/comm/mpi.py)
        if self.mpi == "openmpi":
            e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        names = sorted({"PDIST_NODE_LINK", "PDIST_LINK_GBPS", "PDIST_COOPERATIVE_WAIT", "PATH", "PYTHONPATH", *(k for k in (env or {}) if env[k] is not None)})
        argv = (files.enter(self.plan, "node1", self.files["hosts"])
                + launchers.command(self.mpi, self.mpiexec, self.files, self.nodes, self.ranks_per_node,
                                    [n for n in names if n in e], self.extra)
                + launchers.user_command(cmd, self.python))
        return self._launch(argv, e, timeout, capture)

    def _launch(self, argv, env, timeout, capture):
        from pdist import procs
        before, t0 = self.counters(), time.perf_counter()
        pipe = subprocess.PIPE if capture else None
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, env=env,
                                start_new_session=True, preexec_fn=procs.die_with_parent_how()[0])
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:
            self._stop(proc)
            raise
        if timed_out:
            self._stop(proc)
            out, err = proc.communicate()
        self._stop(proc)
        after = self.counters()
        link = {n: {k: after[n][k] - before[n][k] for k in ("tx", "rx")} for n in after}
        return Result(None if timed_out else proc.returncode, out.decode(errors="replace") if capture else None,
                      err.decode(errors="replace") if capture else None, link, time.perf_counter() - t0,
                      timed_out)

    def _stop(self, proc):
        """Kill the launch's process group (setsid) and every process left inside the nodes."""
        from pdist import procs
        procs.kill_group(proc.pid)
        netns.kill_inside(self.plan["netns"], within=5.0)
