"""Fault injection for teaching: make one rank slow, a shard uneven, a link slow, a
collective skipped, an exception, an exit or a NaN, on purpose, and watch what pdist
does about it (lesson 08, docs/failures.md). Never active unless asked for:

    mpirun -n 4 python lessons/02_data_parallel.py --inject straggler:rank=2,slowdown=1.5
    inject.set("uneven-shard:rank=1,extra=0.3; nan:rank=0,step=3")   # or from code
    inject.clear()

Faults (``kind:key=value,...``; several joined by ``;`` or given as several --inject):

    straggler:rank=R,slowdown=F        after compute, rank R sleeps (F-1) x its measured
                                       compute, every step (a throttled device)
    uneven-shard:rank=R,extra=E[,p=P]  on a random fraction P (default 0.5, seeded by the
                                       step) of steps, rank R's shard holds (1+E) x the
                                       tokens: it sleeps E x its compute, and the detector
                                       sees (1+E) x its tokens (variable-length data)
    slow-link:ranks=A-B,gbps=G[,us=U]  the link between world ranks A and B carries G Gbit/s
                                       with U us latency (default 10): every collective whose
                                       group holds both, and their messages, are charged
                                       its alpha-beta time (pdist/comm/topology.py)
    skip-collective:rank=R,step=S      rank R skips the gradient synchronization of step S
                                       (caught at the next collective: CollectiveMismatchError)
    exception:rank=R,step=S            rank R raises RuntimeError at the start of step S
    exit:rank=R,step=S                 rank R calls sys.exit(0) at the start of step S
                                       (a rank-dependent early exit)
    nan:rank=R,step=S                  rank R writes NaN into a gradient after the compute
                                       of step S (``check_finite``, on by default, names it)

The faults of the step are a step hook (pdist/engine/hooks.py) around the phases of
``Strategy.forward_backward``: ``set`` subscribes the Injector (order 10, inside the
straggler detector and the trace), ``clear`` removes it; nothing injected, nothing
subscribed. Each fault, when it fires, prints
``[inject] rank R step S: ...`` with its wall-clock time (time.time(), so a parent can
measure the time to detection) and adds an instant event to the trace (cat "fault").
"""
import math
import random
import sys
import time

from pdist.engine import hooks
from pdist.measure import trace

ACTIVE = [None]      # the subscribed Injector, or None

KINDS = {"straggler": {"rank": int, "slowdown": float},
         "uneven-shard": {"rank": int, "extra": float, "p": float},
         "slow-link": {"ranks": str, "gbps": float, "us": float},
         "skip-collective": {"rank": int, "step": int},
         "exception": {"rank": int, "step": int},
         "exit": {"rank": int, "step": int},
         "nan": {"rank": int, "step": int}}
REQUIRED = {"straggler": ("rank", "slowdown"), "uneven-shard": ("rank", "extra"),
            "slow-link": ("ranks", "gbps"), "skip-collective": ("rank", "step"),
            "exception": ("rank", "step"), "exit": ("rank", "step"), "nan": ("rank", "step")}


def parse(spec):
    """``"kind:k=v,...; kind:..."`` (or a list of such strings) -> [(kind, {k: v})].
    Raises ValueError naming what is wrong (an unknown kind or key, a missing key)."""
    specs = [spec] if isinstance(spec, str) else list(spec or [])
    out = []
    for part in (p.strip() for s in specs for p in s.split(";")):
        if not part:
            continue
        kind, _, rest = part.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"--inject {part!r}: unknown fault {kind!r}; one of {', '.join(KINDS)}")
        kv = {}
        for item in (i.strip() for i in rest.split(",") if i.strip()):
            k, eq, v = item.partition("=")
            if not eq or k not in KINDS[kind]:
                raise ValueError(f"--inject {part!r}: {item!r} is not key=value with a key of "
                                 f"{kind} ({', '.join(KINDS[kind])})")
            try:
                kv[k] = KINDS[kind][k](v)
            except ValueError:
                raise ValueError(f"--inject {part!r}: {k}={v!r} is not a {KINDS[kind][k].__name__}") from None
        missing = [k for k in REQUIRED[kind] if k not in kv]
        if missing:
            raise ValueError(f"--inject {part!r}: {kind} needs {', '.join(missing)}")
        _check_values(part, kind, kv)
        if kind == "slow-link":
            a, _, b = kv["ranks"].partition("-")
            if not (a.isdigit() and b.isdigit()) or a == b:
                raise ValueError(f"--inject {part!r}: ranks must be two world ranks A-B")
            kv["ranks"] = (int(a), int(b))
        out.append((kind, kv))
    return out


def _check_values(part, kind, kv):
    """The ranges of the values (finite, and what each fault can do)."""
    bad = [k for k, v in kv.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise ValueError(f"--inject {part!r}: {bad[0]} must be a finite number")
    rules = [("slowdown", lambda v: v >= 1, "must be >= 1 (1 = no slowdown)"),
             ("extra", lambda v: v >= 0, "must be >= 0 (0.3 = 30% more tokens)"),
             ("p", lambda v: 0 <= v <= 1, "must be in [0, 1] (a fraction of the steps)"),
             ("gbps", lambda v: v > 0, "must be > 0 Gbit/s"), ("us", lambda v: v >= 0, "must be >= 0 us"),
             ("rank", lambda v: v >= 0, "must be a rank >= 0"), ("step", lambda v: v >= 0, "must be a step >= 0")]
    for k, ok, why in rules:
        if k in kv and not ok(kv[k]):
            raise ValueError(f"--inject {part!r}: {k}={kv[k]} {why}")


def check(faults, world_size, steps=None):
    """Usage errors for faults that cannot fire: a rank outside [0, world_size), a step
    outside [0, steps) (each when known, not None). ``faults``: ``parse``'s list. Returns it."""
    for kind, kv in faults:
        spec = f"{kind}:" + ",".join(f"{k}={'-'.join(map(str, v)) if isinstance(v, tuple) else v}"
                                     for k, v in kv.items())
        ranks = kv["ranks"] if kind == "slow-link" else (kv["rank"],)
        missing = [r for r in ranks if world_size is not None and r >= world_size]
        if missing:
            raise ValueError(f"--inject {spec!r}: rank {missing[0]} does not exist: this job has {world_size} "
                             f"rank(s), 0..{world_size - 1} (the fault would never fire)")
        if steps is not None and kv.get("step", 0) >= steps:
            raise ValueError(f"--inject {spec!r}: step {kv['step']} does not exist: this run trains steps "
                             f"0..{steps - 1} (--steps {steps}; the fault would never fire)")
    return faults


def _rank():
    from pdist import comm
    return comm.get_world().rank


def _first_grad(model):
    """The first gradient this rank holds after the compute: the first strategy of the chain
    whose tensors have one (under bf16/fp16 the fp32 masters get theirs only after the
    sync, so the NaN goes into the low-precision gradient the sync averages)."""
    for s in (model.chain() if hasattr(model, "chain") else [model]):
        g = next((t.grad for t in s.parameters() if t.grad is not None), None)
        if g is not None:
            return g
    raise RuntimeError("--inject nan: this rank holds no gradient after the compute (no parameter "
                       "of the model requires a gradient here), so there is nothing to poison")


class Injector(hooks.StepHook):
    """The faults this rank takes part in (parsed once; the hooks are plain lookups).
    As a step hook: ``before_step`` at the start, ``after_compute`` after the compute
    (with its seconds; the uneven shard's token scale goes to the detector's record),
    and ``skip_sync`` skips the gradient synchronization."""

    order = 10           # inside the detector and the trace: an injected delay counts as compute

    def __init__(self, faults, rank):
        self.faults, self.rank = faults, rank
        mine = [(k, kv) for k, kv in faults if kv.get("rank", rank) == rank]
        self.slow = next((kv["slowdown"] for k, kv in mine if k == "straggler"), 1.0)
        self.uneven = next((kv for k, kv in mine if k == "uneven-shard"), None)
        self.at = {(k, kv["step"]) for k, kv in mine if "step" in kv}
        self.token_scale = 1.0
        for k, kv in mine:       # the trace marks when each fault was switched on
            trace.instant(f"inject {k}", cat="fault", **{a: str(v) for a, v in kv.items()})

    def begin(self, s):
        self.before_step(s.step)

    def enter(self, s, phase):
        if phase == "compute":
            self._t = time.perf_counter()

    def exit(self, s, phase):
        if phase == "compute":
            self.after_compute(s.model, s.step, time.perf_counter() - self._t)
            s.tokens *= self.token_scale

    def skip(self, s, phase):
        return phase == "grad_sync" and self.skip_sync(s.step)

    def _say(self, step, what, **args):
        print(f"[inject] rank {self.rank} step {step}: {what} at t={time.time():.6f}", flush=True)
        trace.instant(what, cat="fault", rank=self.rank, step=step, **args)

    def before_step(self, step):
        if ("exception", step) in self.at:
            self._say(step, "exception")
            raise RuntimeError(f"injected exception on rank {self.rank} at step {step} (--inject exception)")
        if ("exit", step) in self.at:
            self._say(step, "exit")
            sys.exit(0)

    def after_compute(self, model, step, seconds):
        """Sleep to make this rank a straggler / an uneven shard; poison a gradient."""
        self.token_scale, extra = 1.0, self.slow - 1.0
        u = self.uneven
        if u is not None and random.Random(step).random() < u.get("p", 0.5):
            extra += u["extra"]
            self.token_scale = 1.0 + u["extra"]
        if extra > 0:
            with hooks.span("injected delay", factor=1 + extra):   # the trace and the waterfall: compute
                time.sleep(extra * seconds)
        if ("nan", step) in self.at:
            _first_grad(model).reshape(-1)[0] = float("nan")
            self._say(step, "nan")

    def skip_sync(self, step):
        if ("skip-collective", step) in self.at:
            self._say(step, "skip-collective")
            return True
        return False


def set(spec, steps=None):
    """Activate the faults of ``spec`` (see the module doc) on this rank; ``None`` or ""
    clears. Collective only through ``comm.get_world()`` (no communication). A slow link
    is installed in the simulated topology (pdist/comm/topology.py). A fault that cannot
    fire (a rank not in the world; a step >= ``steps``, when given) is a ValueError."""
    from pdist import comm
    faults = parse(spec)
    if faults:
        check(faults, comm.get_world().size, steps)
    from pdist.comm import topology
    topology.set_slow_links([(kv["ranks"], kv["gbps"], kv.get("us", 10.0)) for k, kv in faults
                             if k == "slow-link"])
    if ACTIVE[0] is not None:
        hooks.unsubscribe(ACTIVE[0])
    ACTIVE[0] = Injector(faults, _rank()) if any(k != "slow-link" for k, _ in faults) else None
    if ACTIVE[0] is not None:
        hooks.subscribe(ACTIVE[0])
    return faults


def clear():
    if ACTIVE[0] is not None:
        hooks.unsubscribe(ACTIVE[0])
    ACTIVE[0] = None
    from pdist.comm import topology
    topology.set_slow_links([])


__all__ = ["parse", "check", "set", "clear", "ACTIVE", "Injector", "KINDS"]
