"""Per-rank timeline: spans of communication and compute, merged into one
Chrome / Perfetto trace (open it at https://ui.perfetto.dev or chrome://tracing).

An event is ``(name, cat, start, end, args)`` with ``start``/``end`` from
``time.perf_counter()`` (seconds). Every collective and point-to-point call of a
``ProcessGroup`` records one (cat ``"comm"``, args ``op``, ``bytes``, ``group``);
other code records its own:

    from pdist.measure import trace
    with trace.span("forward", cat="compute", mb=3):
        y = model(x)
    trace.write_chrome_trace("trace.json", world)     # collective: every rank calls it

Tracks (one Chrome "thread" per category, so a straggler reads at a glance):
``comm`` (tid 0: each collective, issue to completion), ``compute`` (tid 1),
``wait`` (tid 2: polled waits for other ranks, longer than 50 us, pdist/comm/mpi.py;
only with ``set_detail(True)``, which lessons' ``--trace`` turns on, or PDIST_TRACE_DETAIL=1),
``link`` (tid 3: the simulated link time of pdist/comm/topology.py), ``step``
(tid 4: the compute and grad_sync phases of ``forward_backward``, pdist/parallel/base.py;
with detail too), ``device`` (tid 5: on a GPU, with detail, when the device ran each
forward and backward, measured with CUDA events: ``device_mark``), ``waterfall`` (tid 6: each
step's parts laid end to end from the step's start, pdist/measure/waterfall.py); an
``instant(name, cat="fault")`` (an injected fault, pdist/faults/inject.py) is an
instant event (``"ph": "i"``, ``"s": "p"``) across the rank's tracks; a ``counter(name, **values)``
is a counter sample (``"ph": "C"``: the memory timeline's bytes by category, pdist/measure/memory_timeline.py).

Alignment. ``write_chrome_trace`` runs a barrier; each rank reads its clock as it
leaves, and rank r's times become ``t - t_barrier_r``: the ranks' clocks are
aligned at the barrier exit (error: the barrier's exit skew, microseconds on one
node), which also works across nodes whose clocks differ.

The step's spans come through step hooks (pdist/engine/hooks.py): while recording,
the trace subscribes a span around each micro-batch's forward and backward (cat
"compute", args mb); with detail also the phases (cat "step").

Cost. Recording is on by default and costs about a microsecond (one tuple
appended); the buffer keeps the newest ``PDIST_TRACE_MAX`` events (default
200000), so a long run never grows without bound. ``disable()`` makes ``span``
and ``record`` a single flag check and unsubscribes the step hooks;
``PDIST_TRACE=0`` starts disabled.
"""
import collections
import json
import time

from pdist.engine.backend import device_event, elapsed_seconds, synchronize
from pdist.engine.env import env_flag, env_number
from pdist.engine import hooks

_cfg = {"on": env_flag("PDIST_TRACE", True), "world": None}
DETAIL = [env_flag("PDIST_TRACE_DETAIL", False)]   # also the waits and the step phases (see below)
_events = collections.deque(maxlen=env_number("PDIST_TRACE_MAX", 200000, "integer (events kept)", 200000,
                                              integer=True))
_device = collections.deque(maxlen=_events.maxlen)   # (name, start event, end event, args): GPU time
_anchor = []        # (event, perf_counter seconds): where the device clock meets the host's
now = time.perf_counter


def set_world(group):
    """The group ``write_chrome_trace`` uses by default (``comm.init()`` sets the world)."""
    _cfg["world"] = group


def world():
    """The group ``set_world`` registered (after ``comm.init()``: the world), or None."""
    return _cfg["world"]


def enable():
    _cfg["on"] = True
    _subscribe()


def disable():
    _cfg["on"] = False
    _subscribe()


def set_detail(flag=True):
    """Also record every wait longer than 50 us and each step's phases (lessons' --trace)."""
    DETAIL[0] = bool(flag)
    _subscribe()


def enabled():
    return _cfg["on"]


def clear():
    _events.clear()
    _device.clear()


def record(name, cat, start, end, **args):
    """Add one finished span (perf_counter seconds)."""
    if _cfg["on"]:
        _events.append((name, cat, start, end, args))


def record_args(name, cat, start, end, args):
    """``record`` with the args as one dict (a hot path's cached one: events() copies it)."""
    if _cfg["on"]:
        _events.append((name, cat, start, end, args))


def instant(name, cat="fault", **args):
    """Add one instant event (a moment, e.g. an injected fault): ``"ph": "i"`` in the file."""
    if _cfg["on"]:
        _events.append((name, cat, now(), None, args))


def counter(name, **values):
    """Add one sample of a counter track (``"ph": "C"``: Perfetto draws the values stacked),
    e.g. ``counter("memory", params=..., grads=...)`` (pdist/measure/memory_timeline.py)."""
    if _cfg["on"]:
        _events.append((name, "counter", now(), None, values))


class span:
    """``with trace.span(name, cat="comm", **args):`` records the block's span."""
    __slots__ = ("name", "cat", "args", "t0")

    def __init__(self, name, cat="comm", **args):
        self.name, self.cat, self.args = name, cat, args

    def __enter__(self):
        self.t0 = now()
        return self

    def __exit__(self, *exc):
        if _cfg["on"]:
            _events.append((self.name, self.cat, self.t0, now(), self.args))
        return False


def device_mark():
    """Where device work starts: a CUDA event on the current stream when on a GPU and
    recording detail (``set_detail``); None otherwise (then ``device_record`` does nothing).

    Why: a GPU runs its kernels after the host has queued them, so a host clock measures
    when work was queued. Two events bracket the kernels themselves; the span they give
    goes on the trace's ``device`` track, beside the host's span of the same work. The
    first mark synchronizes once and records an anchor event at a known host time, so
    device spans are placed on the host's clock: start = t_anchor + elapsed(anchor, e0)."""
    if not (DETAIL[0] and _cfg["on"]):
        return None
    if not _anchor:
        synchronize()               # an idle stream: the anchor runs as the host reads its clock
        t = now()
        ev = device_event()
        if ev is None:
            return None
        _anchor.append((ev, t))
    return device_event()


def device_record(name, start_event, **args):
    """Close a device span opened by ``device_mark()`` (no-op when it returned None)."""
    if start_event is not None:
        _device.append((name, start_event, device_event(), args))


class device_span(span):
    """``span`` that also records the block's device time (``device_mark``) on a GPU."""
    __slots__ = ("e0",)

    def __enter__(self):
        self.e0 = device_mark()
        return span.__enter__(self)

    def __exit__(self, *exc):
        device_record(self.name, self.e0, **self.args)
        return span.__exit__(self, *exc)


class _Passes(hooks.StepHook):
    """Each micro-batch's forward and backward: a "compute" span (and its device time)."""

    def span(self, name, **args):
        return device_span(name, cat="compute", **args)


class _Phases(hooks.StepHook):
    """Detail: the compute and grad_sync phases on the "step" track, recorded at the
    step's end, each from the end of the phase before it to its own end."""

    def begin(self, s):
        self.ends = {}

    def exit(self, s, phase):
        self.ends[phase] = now()

    def end(self, s):
        e = self.ends
        record("compute", "step", e["zero_grad"], e["compute"], step=s.step)
        record("grad_sync", "step", e["compute"], e["grad_sync"], step=s.step)


_PASSES, _PHASES = _Passes(), _Phases()


def _subscribe():
    """The step hooks this state asks for: passes while recording, phases with detail too."""
    for hook, on in ((_PASSES, _cfg["on"]), (_PHASES, _cfg["on"] and DETAIL[0])):
        (hooks.subscribe if on else hooks.unsubscribe)(hook)


def _device_events():
    """The device spans on the host clock (waits for the last one's kernels)."""
    if not _device:
        return []
    ev0, t0 = _anchor[0]
    return [{"name": n, "cat": "device", "start": t0 + elapsed_seconds(ev0, a),
             "end": t0 + elapsed_seconds(ev0, b), "args": dict(args)} for n, a, b, args in _device]


def events():
    """This rank's events as dicts: name, cat, start, end (seconds), args; device spans
    (GPU, with detail) come last, with cat ``"device"``."""
    return ([{"name": n, "cat": c, "start": s, "end": e, "args": dict(a)} for n, c, s, e, a in _events]
            + _device_events())


_subscribe()
TRACKS = {"comm": 0, "compute": 1, "wait": 2, "link": 3, "step": 4, "device": 5, "waterfall": 6}


def chrome_events(evs, pid, t0):
    """Chrome trace events for one rank (microseconds): 'complete' events ("ph": "X")
    on the track of their category (``TRACKS``; others on the compute track), and
    instant events ("ph": "i", "s": "p") for moments."""
    out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}}]
    out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": cat}}
            for cat, tid in TRACKS.items()]
    for e in evs:
        args = {k: _plain(v) for k, v in e["args"].items()}
        if e["cat"] == "counter":
            out.append({"name": e["name"], "ph": "C", "pid": pid, "ts": (e["start"] - t0) * 1e6, "args": args})
            continue
        if e["end"] is None:
            out.append({"name": e["name"], "cat": e["cat"], "ph": "i", "s": "p", "pid": pid, "tid": 1,
                        "ts": (e["start"] - t0) * 1e6, "args": args})
            continue
        out.append({"name": e["name"], "cat": e["cat"], "ph": "X", "pid": pid,
                    "tid": TRACKS.get(e["cat"], 1),
                    "ts": (e["start"] - t0) * 1e6, "dur": max(0.0, (e["end"] - e["start"]) * 1e6),
                    "args": args})
    return out


def _plain(v):
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def write_chrome_trace(path, group=None):
    """Gather every rank's events to rank 0 of ``group`` (default: ``world()``, the one
    ``comm.init()`` registered: this module imports nothing of pdist.comm) and write one
    Chrome/Perfetto JSON there (pid = rank within the group, tid 0 = communication, tid 1 =
    everything else). Collective; returns the event count on rank 0, None elsewhere."""
    group = group or world()
    if group is None:
        raise RuntimeError("write_chrome_trace: call pdist.comm.init() first (or pass a group)")
    was_on = _cfg["on"]
    _cfg["on"] = False                       # do not trace the gather itself
    try:
        group.barrier()
        t_sync = now()
        mine = events()
        for e in mine:
            e["start"] -= t_sync
            if e["end"] is not None:
                e["end"] -= t_sync
        per_rank = group.gather_object(mine, dst=0)
    finally:
        _cfg["on"] = was_on
    if group.rank != 0:
        return None
    starts = [e["start"] for evs in per_rank for e in evs]
    t0 = min(starts) if starts else 0.0
    merged = []
    for r, evs in enumerate(per_rank):
        merged.extend(chrome_events(evs, r, t0))
    with open(path, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    return sum(len(evs) for evs in per_rank)


def comm_seconds(evs=None):
    """Total seconds spent inside 'comm' spans (overlaps counted once)."""
    evs = events() if evs is None else evs
    spans = sorted((e["start"], e["end"]) for e in evs if e["cat"] == "comm" and e["end"] is not None)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)
