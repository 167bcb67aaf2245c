"""Step hooks (pdist/engine/hooks.py): the phases of forward_backward are plain calls, and
the instruments (straggler detector, fault injection, trace, memory timeline) subscribe
to them. One process, no MPI: ``Local`` talks to no rank."""
import numpy as np
import pytest

from pdist.faults import debug, inject
from pdist.engine import hooks
from pdist.measure import memory_timeline, trace
from pdist.models.gpt import GPT, GPTConfig
from pdist.parallel.base import Local

CFG = GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=16, dtype="float64")
XY = tuple(np.random.default_rng(0).integers(0, 50, (4, 8)) for _ in range(2))


class Counted(Local):
    """Local that counts its gradient synchronizations (a real one would all-reduce)."""
    syncs = 0

    def finish_grad_sync(self):
        self.syncs += 1


@pytest.fixture
def quiet():
    """Nothing subscribed during the test; the process's subscribers and trace state after."""
    saved, detail, on = hooks.subscribers(), trace.DETAIL[0], trace.enabled()
    inject.clear()
    for h in saved:
        hooks.unsubscribe(h)
    yield
    inject.clear()
    for h in hooks.subscribers():
        hooks.unsubscribe(h)
    for h in saved:
        hooks.subscribe(h)
    trace.set_detail(detail)
    (trace.enable if on else trace.disable)()


def clocks(monkeypatch):
    """Count the detector's and the trace's clock reads."""
    n = [0]

    def counting(real):
        def now():
            n[0] += 1
            return real()
        return now
    monkeypatch.setattr(debug, "now", counting(debug.now))
    monkeypatch.setattr(trace, "now", counting(trace.now))
    return n


def test_nothing_subscribed_reads_no_clock(quiet, monkeypatch):
    n = clocks(monkeypatch)
    m = Local(GPT(CFG, 0), microbatches=2)
    names = [type(h).__name__ for h in hooks.defaults()]   # the step's own bookkeeping: on, and clock-free
    assert hooks.subscribers() == [] and names[:3] == ["StepStamp", "FiniteCheck", "IndexChecks"]
    assert set(names[3:]) <= {"PipelineStats"}, names
    debug.clear()
    trace.clear()
    loss = m.forward_backward(*XY)
    assert n[0] == 0 and debug.records() == [] and trace.events() == [] and np.isfinite(loss)
    debug.enable()                        # the detector alone: the start and each phase's end
    m.forward_backward(*XY)
    assert n[0] == 5 and [r["step"] for r in debug.records()] == [1] and debug.records()[0]["tokens"] == 32
    trace.enable()                        # the trace: a span per micro-batch pass (2 clock reads each)
    m.forward_backward(*XY)
    assert n[0] == 5 + 5 + 8
    assert [(e["name"], e["args"]) for e in trace.events()] == [
        ("forward", {"mb": 0}), ("backward", {"mb": 0}), ("forward", {"mb": 1}), ("backward", {"mb": 1})]
    trace.set_detail(True)                # and the phases on the "step" track
    trace.clear()
    m.forward_backward(*XY)
    steps = [(e["name"], e["args"]) for e in trace.events() if e["cat"] == "step"]
    assert steps == [("compute", {"step": 3}), ("grad_sync", {"step": 3})]
    debug.disable()
    trace.disable()
    assert hooks.subscribers() == []


class Log(hooks.StepHook):
    def __init__(self, tag, log, skip=()):
        self.tag, self.log, self.skips = tag, log, skip

    def begin(self, s):
        self.log.append((self.tag, "begin", s.step))

    def enter(self, s, phase):
        self.log.append((self.tag, "enter", phase))

    def skip(self, s, phase):
        return phase in self.skips

    def exit(self, s, phase):
        self.log.append((self.tag, "exit", phase))

    def end(self, s):
        self.log.append((self.tag, "end", s.step))


def test_subscribers_nest_by_order_and_can_skip_a_phase(quiet):
    log, m = [], Counted(GPT(CFG, 0))
    hooks.subscribe(Log("in", log, skip=("grad_sync",)), order=10)
    hooks.subscribe(Log("out", log))      # order 0: outside, though subscribed later
    m.forward_backward(*XY, step=7)
    assert m.syncs == 0 and m.steps == 8
    assert log[:4] == [("out", "begin", 7), ("in", "begin", 7), ("out", "enter", "zero_grad"),
                       ("in", "enter", "zero_grad")]
    assert log[4:6] == [("in", "exit", "zero_grad"), ("out", "exit", "zero_grad")]
    assert [p for t, e, p in log if e == "exit" and t == "out"] == list(hooks.PHASES)   # a skipped one too
    assert log[-2:] == [("in", "end", 7), ("out", "end", 7)]


def test_injected_faults_act_through_their_hook(quiet, monkeypatch):
    """skip-collective skips the sync of its step; the uneven shard sleeps inside the
    detector's compute and scales the tokens it records; clear() unsubscribes."""
    monkeypatch.setattr(inject, "_rank", lambda: 0)
    m = Counted(GPT(CFG, 0))
    debug.enable()
    for _ in range(3):                                              # plain steps: their compute
        m.forward_backward(*XY)
    plain = min(r["compute"] for r in debug.records())
    debug.clear()
    inject.set("uneven-shard:rank=0,extra=20.0,p=1; skip-collective:rank=0,step=4")
    assert inject.ACTIVE[0] in hooks.subscribers()
    for _ in range(3):
        m.forward_backward(*XY)
    assert m.syncs == 3 + 2                                         # step 4's sync skipped
    recs = debug.records()
    assert [r["tokens"] for r in recs] == [21.0 * 32] * 3
    inject.clear()
    assert inject.ACTIVE[0] is None and hooks.subscribers() == [debug.DETECTOR]
    m.forward_backward(*XY)
    assert debug.records()[-1]["tokens"] == 32 and m.syncs == 6
    compute = min(r["compute"] for r in recs)                      # slept 20 x its compute, in compute
    assert compute > 5 * plain and max(r["grad_sync"] for r in recs) < 0.5 * compute, (recs, plain)
    debug.disable()


def test_memory_timeline_samples_each_phase_and_event(quiet):
    m = Local(GPT(CFG, 0))
    with memory_timeline.record(m) as tl:
        m.forward_backward(*XY)
        memory_timeline.mark("free", "unit0")
    assert [e for e, _ in tl.events()] == ["start", *hooks.PHASES, "free", "end"]
    assert tl.events("free") == [("free", "unit0")] and hooks.subscribers() == []
    grads = {s[1]: s[4] for s in tl.samples}                         # (t, event, unit, params, grads, ...)
    assert grads["zero_grad"] == 0 and grads["compute"] > 0          # the grads exist after compute
