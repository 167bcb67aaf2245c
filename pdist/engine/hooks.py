"""Step hooks: where the instruments attach to the training step (docs/design.md, the phases).

The core runs the step; instruments subscribe to it. ``Strategy.forward_backward``
(pdist/parallel/base.py) runs its phases through ``step(model, x)``, ``Local.compute``
wraps each micro-batch's forward and backward in ``span(name, mb=i)``, and ZeRO announces
its memory events with ``event(name, unit)``; the engine's activation recomputation
(recompute.py) wraps the forward it runs again in ``span("recompute")``. The core imports
none of the instruments; they import this module, and it imports nothing, so it sits on
the floor, in the engine, where recompute reaches it without an import running back up
(docs/design.md, "Modules"). With nothing subscribed, a phase costs one call and a truth
test, a pass one truth test, and nobody reads a clock.

The step's own bookkeeping subscribes here too, as *defaults* (``default = True``; the
parallel layer subscribes them when it is imported, pdist/parallel/step_checks.py): the
step stamp and the batch's hash on every collective, the token-id checks deferred to one
host read, the non-finite count. They read no clock. ``subscribers()`` lists the others,
the instruments; ``defaults()`` the defaults.

A subscriber is a ``StepHook`` overriding what it needs (the rest stay no-ops):

    begin(s)            before the first phase. s, the ``Step``: s.model (the strategy whose
                        forward_backward runs), s.step (the training step), s.tokens (this
                        rank's tokens, x.size; fault injection scales it for an uneven shard)
    enter(s, phase)     before each phase of PHASES
    skip(s, phase)      True: the phase does not run this step (it returns None)
    around(s, phase)    a context manager around the phase's call, or None
    exit(s, phase)      after each phase, skipped or not; s.results[phase] is what it returned
    end(s)              after the last phase (not reached when a phase raised)
    span(name, **args)  a context manager around one micro-batch's forward or backward
    event(name, unit)   a memory event ("all-gather", "free", "reduce-scatter", "all-reduce")

A subscriber may add numbers to ``s.counts`` before the "stats" phase: they travel in the
step's one reduction beside the loss (``forward_backward`` reduces [loss, *s.counts]), so
every rank reads every rank's count in ``s.results["stats"]`` without a collective of its own.

Subscribers nest as context managers do, by ``order`` (lower: outer; ties: first
subscribed outer): begin and enter run outer first, exit and end inner first. Who
subscribes, and when:

    straggler detector  order 0   when pdist.faults.debug is imported (debug.disable/enable)
    trace, phases       order 0   while trace detail is on (trace.set_detail, PDIST_TRACE_DETAIL)
    trace, passes       order 0   while the trace records (the default; trace.disable/enable)
    fault injection     order 10  from inject.set(spec) with a fault of the step, to inject.clear()
    memory timeline     order 0   inside ``with memory_timeline.record(...)``

Fault injection sits inside the detector and the trace, so an injected delay counts as
compute and the detector sees the scaled tokens.
"""
import contextlib

PHASES = ("zero_grad", "compute", "grad_sync", "stats")
_STEP = ("begin", "enter", "skip", "around", "exit", "end")
_subs = []               # [(order, seq, hook)], sorted
_seq = [0]


class StepHook:
    """The no-op subscriber: subclass it and override any of the methods (module doc)."""

    order = 0
    default = False           # True: the step's own bookkeeping (module doc), not an instrument

    def begin(self, s):
        pass

    def enter(self, s, phase):
        pass

    def skip(self, s, phase):
        return False

    def around(self, s, phase):
        return None

    def exit(self, s, phase):
        pass

    def end(self, s):
        pass

    def span(self, name, **args):
        return None

    def event(self, name, unit=None):
        pass


def _overrides(hook, name):
    return getattr(type(hook), name) is not getattr(StepHook, name)


def _by_method():
    """{method: the subscribers that override it, in call order}: exit and end inner first."""
    hooks = [h for _, _, h in _subs]
    out = {m: tuple(h for h in hooks if _overrides(h, m)) for m in _STEP + ("span", "event")}
    out["exit"], out["end"] = out["exit"][::-1], out["end"][::-1]
    out["any"] = any(out[m] for m in _STEP)
    return out


_calls = _by_method()


def subscribe(hook, order=None):
    """Add ``hook`` (a StepHook) at ``order`` (default: ``hook.order``); again: a no-op."""
    if not isinstance(hook, StepHook):
        raise TypeError(f"hooks.subscribe: {type(hook).__name__} is not a pdist.engine.hooks.StepHook; "
                        "subclass it and override begin/enter/skip/around/exit/end/span/event")
    global _calls
    if not any(h is hook for _, _, h in _subs):
        _seq[0] += 1
        _subs.append((hook.order if order is None else order, _seq[0], hook))
        _subs.sort(key=lambda e: e[:2])
        _calls = _by_method()
    return hook


def unsubscribe(hook):
    """Remove ``hook`` (not subscribed: a no-op)."""
    global _calls
    _subs[:] = [e for e in _subs if e[2] is not hook]
    _calls = _by_method()


def subscribers():
    """The subscribed instruments, outer first (the defaults left out: ``defaults()``)."""
    return [h for _, _, h in _subs if not h.default]


def defaults():
    """The subscribed defaults (the step's own bookkeeping), outer first."""
    return [h for _, _, h in _subs if h.default]


class Step:
    """One ``forward_backward`` with subscribers: ``run(phase, fn, *args)`` calls ``fn(*args)``
    between the subscribers' enter and exit (not when one says skip), inside their ``around``;
    ``run.end()``. ``step``: the training step (default: the model's next, ``model.steps``)."""

    __slots__ = ("model", "step", "tokens", "counts", "results", "_enter", "_skip", "_around", "_exit", "_end")

    def __init__(self, model, x, calls, step=None):
        self.model, self.tokens = model, getattr(x, "size", 0)
        self.step = model.steps if step is None else int(step)
        self.counts, self.results = [], {}
        self._enter, self._skip, self._around = calls["enter"], calls["skip"], calls["around"]
        self._exit, self._end = calls["exit"], calls["end"]
        for h in calls["begin"]:
            h.begin(self)

    def __call__(self, phase, fn, *args):
        for h in self._enter:
            h.enter(self, phase)
        if self._skip and any(h.skip(self, phase) for h in self._skip):
            out = None
        elif self._around:
            with _nested(h.around(self, phase) for h in self._around):
                out = fn(*args)
        else:
            out = fn(*args)
        self.results[phase] = out
        for h in self._exit:
            h.exit(self, phase)
        return out

    def end(self):
        for h in self._end:
            h.end(self)


class _Off:
    """The step when nothing is subscribed: each phase is its plain call."""

    __slots__ = ()
    counts = ()

    def __call__(self, phase, fn, *args):
        return fn(*args)

    def end(self):
        pass


OFF = _Off()
_NULL = contextlib.nullcontext()


def step(model, x, step=None):
    """The runner of one step of ``model`` on this rank's rows ``x``: a ``Step`` when a
    subscriber listens to the phases, else ``OFF``."""
    c = _calls
    return Step(model, x, c, step) if c["any"] else OFF


def _nested(cms):
    """The context managers ``cms`` (None: none) entered in order, as one."""
    stack = contextlib.ExitStack()
    for cm in cms:
        if cm is not None:
            stack.enter_context(cm)
    return stack


def span(name, **args):
    """``with hooks.span("forward", mb=i):`` every subscriber's span around the block."""
    hs = _calls["span"]
    if not hs:
        return _NULL
    if len(hs) == 1:
        return hs[0].span(name, **args) or _NULL
    return _nested(h.span(name, **args) for h in hs)


def event(name, unit=None):
    """A memory event of a strategy (ZeRO: a unit gathered, freed, its gradient reduced)."""
    for h in _calls["event"]:
        h.event(name, unit)


__all__ = ["StepHook", "Step", "PHASES", "subscribe", "unsubscribe", "subscribers", "defaults", "step", "span", "event",
           "OFF"]
