"""The measured waterfall: every step's wall time, per rank, as parts that add up to it.

    wf = Waterfall(model)                     # subscribes; collective only in resolve/table
    for step in range(steps):
        wf.start()
        loss = model.forward_backward(*model.local_batch(*get_batch(step)))
        opt.step(); opt.zero_grad()
        wf.stop()                             # collective (one all-gather): the step's parts
        wf.parts                              # {"ideal compute": s, ..., "framework overhead": s}
    print(wf.table())                         # collective: one column per rank, the sum check, MFU
    wf.close()

``Waterfall(auto=True)`` times every ``forward_backward`` instead (the step hooks' begin and
end; lessons' ``--waterfall``) and resolves at ``table()``. Parts of a step of S seconds
(host clock; pdist/measure/blocked.py records the intervals the host spends inside
communication, outermost call only, and the passes are the step hooks' spans):

    ideal compute         F / R: this rank's model FLOPs (pdist/measure/flops.py, the named
                          convention; F = FLOPs/token x this replica's tokens / (tp x pp)) at
                          the measured GEMM rate R (the best of the ranks' measurements);
                          at most the passes' compute
    kernel inefficiency   the passes' compute (the step hooks' spans: each forward and
                          backward, a pipeline's instructions, an injected straggler's delay;
                          less the time blocked in communication inside them) less
                          recompute, less ideal
    recompute             the recomputed forwards inside backward (pdist/engine/recompute.py)
    pipeline bubble       blocked in a pipeline's point-to-point (waiting for a neighbour stage)
    comm <group>          blocked in that group's collectives, less the waiting below: the
                          exposed communication (what overlap hid is in no interval)
    waiting for slower rank  per collective, the part of this rank's blocked time before the
                          last member arrived: min(t1, max_q arrival_q) - t0, clipped to
                          [0, t1 - t0]; a member arrives when it enters the collective or,
                          async, begins to wait on it (MPI progresses it only inside MPI calls);
                          the clocks aligned at a barrier's exit
    framework overhead    the remainder, S - compute - every blocked interval, never negative:
                          the optimizer, zero_grad, data, Python between the passes

So the parts sum to S by construction unless intervals were double counted; the tests check
the sum against an independent clock within 3% on every layout (tests/test_waterfall.py).
Why the default FLOP convention is 6N+12LhT: pdist/measure/flops.py. On a GPU the host clock sees
when kernels were queued: compute shows up where the host waits for the device (run with
trace detail for the device track). The trace holds the waterfall: ``resolve`` records each
step's parts end to end on the trace's "waterfall" track.
"""
import collections

from pdist.engine import hooks
from pdist.measure import blocked, flops, trace

PARTS = ("ideal compute", "kernel inefficiency", "recompute", "pipeline bubble")
WAIT, OVERHEAD = "waiting for slower rank", "framework overhead"
now = trace.now


def _config_of(model):
    """The model config (GPTConfig, LlamaConfig) of a strategy or a module, or None."""
    for s in (model.chain() if hasattr(model, "chain") else [model]):
        for m in (s, getattr(s, "module", None)):
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "param_shapes"):
                return cfg
    return None


def _split_degree(model):
    """tp x pp: the ranks that share one replica's tokens (each computes 1/(tp pp) of them)."""
    d = 1
    for s in (model.chain() if hasattr(model, "chain") else []):
        if type(s).__name__ in ("TensorParallel", "PipelineParallel"):
            d *= s.group.size
    return d


def _run_label(model):
    """The chain's class names, ZeRO with its stage, a pipeline with its schedule and m, TP
    with SP: "ZeRO-1 > PipelineParallel(1f1b, m=4) > TensorParallel(SP) > Local"."""
    if not hasattr(model, "chain"):
        return type(model).__name__

    def name(s):
        n = type(s).__name__
        if n == "ZeRO":
            return f"ZeRO-{s.stage}"
        if n == "PipelineParallel":
            return f"{n}({s.schedule}, m={s.num_microbatches})"
        return n + ("(SP)" if getattr(s, "sequence_parallel", False) else "")
    return " > ".join(name(s) for s in model.chain())


def _model_info(model, flops_per_token=None):
    """What a step of ``model`` needs later (no reference to the model is kept): its label,
    FLOPs per token under each convention, tp x pp, and whether it is a pipeline."""
    cfg = _config_of(model)
    per = {c: (flops_per_token if flops_per_token is not None else flops.per_token(cfg, c) if cfg else 0.0)
           for c in flops.CONVENTIONS}
    chain = model.chain() if hasattr(model, "chain") else []
    return {"label": _run_label(model), "per_token": per, "split": _split_degree(model),
            "pipeline": any(getattr(s, "pipeline", False) for s in chain)}


class _Pass:
    """A pass span: its seconds less the seconds blocked inside it go to compute (or recompute)."""
    __slots__ = ("wf", "name", "t0", "b0")

    def __init__(self, wf, name):
        self.wf, self.name = wf, name

    def __enter__(self):
        self.t0, self.b0 = now(), blocked.TOTAL[0]
        return self

    def __exit__(self, *exc):
        r = self.wf._open
        if r is not None:
            net = (now() - self.t0) - (blocked.TOTAL[0] - self.b0)
            r["recompute" if self.name == "recompute" else "compute"] += net
        return False


class Waterfall(hooks.StepHook):
    """Per step, per rank, the parts of the step's wall time (module doc). ``model``: the
    strategy (its config gives the FLOPs; auto mode reads it from each step); ``group``:
    the ranks that resolve together (default: the world, as ``comm.init()`` registered it
    with the trace); ``convention``: MFU's FLOP count
    (flops.CONVENTIONS, default flops.DEFAULT); ``flops_per_token``: override the count."""

    order = 0

    def __init__(self, model=None, group=None, convention=flops.DEFAULT, auto=False, keep=1024,
                 flops_per_token=None):
        if convention not in flops.CONVENTIONS:
            raise ValueError(f"Waterfall: convention must be one of {flops.CONVENTIONS}, got {convention!r}")
        self.model, self.group, self.convention, self.auto = model, group, convention, auto
        self.flops_per_token = flops_per_token
        self.records = collections.deque(maxlen=keep)    # one dict per step (raw, then resolved)
        self.parts, self._open, self._closed = {}, None, False
        self._last_info, self._labels = (None, None), {}
        hooks.subscribe(self)
        blocked.use(+1)

    def close(self):
        """Unsubscribe: the steps read no clock for the waterfall any more."""
        if not self._closed:
            hooks.unsubscribe(self)
            blocked.use(-1)
            self._closed = True

    @property
    def mfu(self):
        """The last resolved step's MFU per convention: {"6N": f, "6N+12LhT": f, "causal": f}."""
        done = [r for r in self.records if r["resolved"]]
        return dict(done[-1]["mfu"]) if done else {}

    # ---------------------------------------------------------------- step hooks
    def begin(self, s):
        if self.auto:
            self.start()
        if self._open is not None:
            self._open.update(info=self._info(s.model), tokens=s.tokens)

    def _info(self, model):
        key = id(model)
        if self._last_info[0] != key:
            self._last_info = (key, _model_info(model, self.flops_per_token))
            seen = self._labels.setdefault(self._last_info[1]["label"], [])
            if key not in seen:
                seen.append(key)
            if len(seen) > 1:     # another model of the same chain (lesson 02's two runs): numbered
                self._last_info[1]["label"] += f" #{seen.index(key) + 1}"
        return self._last_info[1]

    def end(self, s):
        if self.auto:
            self.stop(resolve=False)

    def span(self, name, **args):
        return _Pass(self, name) if self._open is not None else None

    # ------------------------------------------------------------------- steps
    def start(self):
        """The step starts now (before its data, its forward_backward, its optimizer step)."""
        blocked.reset()
        self._open = {"t0": now(), "mark": blocked.COUNT[0], "compute": 0.0, "recompute": 0.0,
                      "info": self._info(self.model) if self.model is not None else None, "tokens": 0,
                      "resolved": False}

    def stop(self, resolve=True):
        """The step ends now; ``resolve``: split the waiting out at once (collective: every
        rank of the group calls stop) and return the parts; else None until ``resolve()``."""
        r, self._open = self._open, None
        if r is None:
            raise RuntimeError("Waterfall.stop() without start() (auto=True times forward_backward itself)")
        r["t1"] = now()
        r["rows"] = blocked.since(r.pop("mark"))
        self.records.append(r)
        return self.resolve()[-1] if resolve else None

    @staticmethod
    def _flops(r, convention):
        """This rank's model FLOPs of step ``r`` under ``convention``."""
        info = r["info"]
        return info["per_token"][convention] * r["tokens"] / info["split"] if info else 0.0

    def resolve(self):
        """Split waiting from wire time in every unresolved step (collective over the group:
        one barrier and one object all-gather of the collectives' entry times); returns the
        parts of every kept step."""
        todo = [r for r in self.records if not r["resolved"]]
        latest, rate = _last_entries(self.group, todo, flops.gemm_rate())
        for r in todo:
            self._parts(r, latest, rate)
            _to_trace(r)
        if self.records:
            self.parts = self.records[-1]["parts"]
        return [r["parts"] for r in self.records]

    def _parts(self, r, latest, rate):
        """Fill ``r["parts"]`` (seconds, PARTS + comm per group + WAIT + OVERHEAD), r["mfu"], r["step_s"]."""
        pipeline = bool(r["info"] and r["info"]["pipeline"])
        comm, bubble, wait, held = collections.defaultdict(float), 0.0, 0.0, 0.0
        for kind, key, name, _, t0, t1 in r["rows"]:
            d = t1 - t0
            held += d
            if kind == "p" and pipeline:
                bubble += d
                continue
            w = min(max(0.0, min(t1, latest.get(key, t0)) - t0), d) if key is not None else 0.0
            wait += w
            comm["comm " + name] += d - w
        step = r["t1"] - r["t0"]
        model_s = max(0.0, r["compute"] - r["recompute"])
        ideal = min(model_s, self._flops(r, self.convention) / rate)
        parts = {"ideal compute": ideal, "kernel inefficiency": model_s - ideal, "recompute": r["recompute"],
                 "pipeline bubble": bubble, **dict(sorted(comm.items())), WAIT: wait,
                 OVERHEAD: max(0.0, step - r["compute"] - held)}
        r.update(parts=parts, step_s=step, resolved=True, label=r["info"]["label"] if r["info"] else "model",
                 mfu={c: self._flops(r, c) / max(step * rate, 1e-30) for c in flops.CONVENTIONS}, rate=rate)

    def table(self, skip=1):
        """One table per run (a strategy chain), a column per rank: each part's ms/step (mean
        over the steps, the first ``skip`` of each run dropped when more remain), the sum of
        the parts beside the measured step, and MFU under each convention. Collective
        (resolves, then one all-gather); returns the text on every rank."""
        self.resolve()
        from pdist.measure import waterfall_table
        per_rank = _gather(self.group, waterfall_table.summary(self.records, skip))
        return waterfall_table.render(per_rank, self.convention)

    def summary(self, skip=1):
        """This rank's means per run: {label: {"parts", "step_s", "sum_s", "mfu", "steps", "rate"}}."""
        from pdist.measure import waterfall_table
        return waterfall_table.summary(self.records, skip)


def _world(group):
    """``group``, else the world ``comm.init()`` registered with the trace, else None."""
    return group or trace.world()


def _gather(group, obj):
    g = _world(group)
    return g.all_gather_object(obj) if g is not None and g.size > 1 else [obj]


def _last_entries(group, todo, rate):
    """({collective key: the last member's arrival} on this rank's clock, the best GEMM rate
    of the ranks): every rank's arrivals, shifted by its clock at a barrier's exit (as
    trace.write_chrome_trace aligns); one rate for all, as the ranks' devices are alike and a
    measurement on shared cores only errs low."""
    g = _world(group)
    arrive = {}
    for r in todo:                         # a member arrives when it enters or begins to wait (blocked.py)
        for _, key, _, te, _, _ in r["rows"]:
            if key is not None and te > arrive.get(key, float("-inf")):
                arrive[key] = te
    mine = list(arrive.items())
    if g is None or g.size == 1:
        return {}, rate
    g.barrier()
    t_sync = now()
    latest, rates = {}, []
    for r, entries in g.all_gather_object((rate, [(k, te - t_sync) for k, te in mine])):
        rates.append(r)
        for k, te in entries:
            if te + t_sync > latest.get(k, float("-inf")):
                latest[k] = te + t_sync
    return latest, max(rates)


def _to_trace(r):
    """The step's parts end to end on the trace's "waterfall" track, from the step's start."""
    t, step = r["t0"], r.get("tokens", 0)
    for name, s in r["parts"].items():
        if s > 0:
            trace.record(name, "waterfall", t, t + s, ms=s * 1e3, tokens=step)
            t += s


__all__ = ["Waterfall", "PARTS", "WAIT", "OVERHEAD"]
