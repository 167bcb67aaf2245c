"""Who is slow, by how much, and where the time went: the straggler detector.

Every ``forward_backward`` (pdist/parallel/base.py) notes, through its step hooks
(pdist/engine/hooks.py: the detector subscribes when this module is imported, so it is
on for anyone who asks for a report; ``disable()``/``enable()``), per step on every rank,
the seconds of each phase (zero_grad, compute, grad_sync, stats: each from the end of the
one before, the first from the step's start), the seconds of each phase
spent *waiting* for other ranks (polled waits that did not finish at once,
``pdist.comm.mpi.WAITED``), the simulated link time (``pdist.comm.topology.LINK``) and
the tokens it computed on. Ten floats in a bounded deque: no communication; the cost
is measured by bench/straggler.py. Then, on demand, on every rank (collective):

    rep = debug.straggler_report(model)            # gathers the last steps of every rank
    print(rep)                                     # names the slow rank, the cause, the phase
    rep.rank, rep.cause, rep.slowdown              # e.g. 2, "throttled device", 1.48
    train(model, opt, batch, steps, on_step=debug.monitor(every=10))   # one gather every K steps

``straggler_report(records)`` also takes records already gathered (a list per rank of
``Record`` dicts, e.g. from ``gather()``), and needs no MPI then.

Signatures (the common causes told apart):

* throttled device: one rank's compute (its phase time less its waits and link time)
  is above the others' median on (almost) every step; the others wait in grad_sync;
* uneven shard: one rank is slow on some steps only, and those are the steps where it
  holds more tokens;
* slow link: nobody's compute stands out; every rank of one group spends the step in
  communication (the link time of the simulated cluster, or the transfer itself),
  not in waiting for a peer. The report names the group and its ranks.
"""
import collections
import time

from pdist.comm import mpi, topology
from pdist.faults import skew
from pdist.faults.skew import _median
from pdist.engine import hooks
from pdist.measure import blocked

FIELDS = ("step", "zero_grad", "compute", "grad_sync", "stats",
          "wait_zero_grad", "wait_compute", "wait_grad_sync", "wait_stats", "link", "tokens",
          "blocked_compute", "entries")
PHASES = ("zero_grad", "compute", "grad_sync", "stats")
KEEP = 256
_records = collections.deque(maxlen=KEEP)
now = time.perf_counter
WAITED, LINK = mpi.WAITED, topology.LINK


def note(rec):
    """Add one step's record (a tuple in FIELDS order; the detector's hook calls this)."""
    _records.append(rec)


class Detector(hooks.StepHook):
    """The clocks of the step (order 0: outside fault injection, whose delay is compute).
    At the start and after each phase: the time, the polled waits; the link time at the
    start and the end. The end notes one record (FIELDS)."""

    def begin(self, s):
        blocked.reset()
        self.marks, self.link0, self.mark = [(now(), WAITED[0], blocked.TOTAL[0])], LINK[0], blocked.COUNT[0]

    def exit(self, s, phase):
        self.marks.append((now(), WAITED[0], blocked.TOTAL[0]))

    def end(self, s):
        (t0, w0, _), (t1, w1, b1), (t2, w2, b2), (t3, w3, _), (t4, w4, _) = self.marks
        entries = [(key, te, int(kind == "w")) for kind, key, _, te, _, _ in blocked.since(self.mark) if key]
        note((s.step, t1 - t0, t2 - t1, t3 - t2, t4 - t3, w1 - w0, w2 - w1, w3 - w2, w4 - w3,
              LINK[0] - self.link0, s.tokens, b2 - b1, entries))


DETECTOR = Detector()


def enable():
    """Record every step (the default once this module is imported)."""
    if DETECTOR not in hooks.subscribers():
        blocked.use(+1)           # the collectives' blocked time and entry times (measure/blocked.py)
    hooks.subscribe(DETECTOR)


def disable():
    """Stop recording: the step reads no clock for the detector."""
    if DETECTOR in hooks.subscribers():
        blocked.use(-1)
    hooks.unsubscribe(DETECTOR)


def clear():
    _records.clear()


def records(last=None):
    """This rank's records as dicts (newest ``last``)."""
    rs = list(_records)[-last:] if last else list(_records)
    return [dict(zip(FIELDS, r)) for r in rs]


def gather(group=None, last=32):
    """Every rank's last ``last`` records and its per-group link seconds, on every
    rank of ``group`` (the world by default): one object all-gather. Collective."""
    from pdist import comm
    from pdist.comm import watchdog
    group = group or comm.get_world()
    links = {g.name: (list(g.ranks), getattr(g, "_link_s", 0.0)) for g in watchdog.groups()
             if getattr(g, "_link_s", 0.0) > 0}
    if group.size > 1:
        group.barrier()          # the entry times on one clock: each rank's, less its barrier exit
    t_sync = now()
    recs = records(last)
    for r in recs:
        r["entries"] = [(k, te - t_sync, w) for k, te, w in r.get("entries") or ()]
    mine = {"rank": group.ranks[group.rank], "records": recs, "links": links, **skew.where()}
    return group.all_gather_object(mine) if group.size > 1 else [mine]


class Report:
    """What ``straggler_report`` found: ``rank`` (None when balanced), ``cause``
    ("throttled device", "uneven shard", "slow link", "intermittent", "balanced"),
    ``slowdown`` (the slow rank's compute / the others' median), ``extra_s`` (its
    extra compute seconds per step), ``phase`` (where the others waited for it, or
    where the time went), ``link`` (slow link: (group name, world ranks, s/step)),
    ``rows`` (per rank: step, compute, wait, comm, link, late seconds per step, mean; late:
    how much later than the others it enters the step's collectives, faults/skew.py);
    ``late``: {world rank: that lateness}."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.late = {r["rank"]: r.get("late", 0.0) for r in kw.get("rows", [])}

    def as_dict(self):
        return dict(self.__dict__)

    def __str__(self):
        head = "rank  step_ms  compute_ms  wait_ms  comm_ms  link_ms  late_ms  tokens"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['rank']:>4}  {r['step'] * 1e3:7.2f}  {r['compute'] * 1e3:10.2f}  "
                         f"{r['wait'] * 1e3:7.2f}  {r['comm'] * 1e3:7.2f}  {r['link'] * 1e3:7.2f}  "
                         f"{r.get('late', 0.0) * 1e3:7.2f}  {r['tokens']:6.0f}")
        return "\n".join(lines + [self.text])


def _mean(v):
    v = list(v)
    return sum(v) / len(v) if v else 0.0


def _align(source, group, last, skip):
    """Every rank's records on the steps all of them recorded, the first ``skip``
    (warm-up) dropped when more remain: (per, steps). ``per``: per rank, a dict of
    rank, records, links, host (a gather when ``source`` is not a list)."""
    if source is None or not isinstance(source, list):
        source = gather(group, last)
    per = [s if isinstance(s, dict) else {"rank": i, "records": s, "links": {}} for i, s in enumerate(source)]
    steps = sorted(set.intersection(*[{r["step"] for r in p["records"]} for p in per])) if per else []
    if len(steps) > skip + 1:
        steps = steps[skip:]
    return per, steps


def _wait(r):
    return sum(r["wait_" + ph] for ph in PHASES)


def _net_compute(r):
    """The compute phase less its waits (TP peers) and its time blocked in communication
    (DDP's buckets issued and waited inside backward, TP's collectives: measure/blocked.py)."""
    return max(0.0, r["compute"] - max(r["wait_compute"], r.get("blocked_compute", 0.0)))


class _Steps:
    """The aligned steps as the diagnoses read them. ``comp[i][j]``: rank i's net
    compute on step j; ``rows``: per rank, the means shown by the report;
    ``excess[i][j]``: rank i's compute over the median of the others' on step j, less 1;
    ``slow``: the rank of the largest mean excess, ``others`` the rest."""

    def __init__(self, per, steps):
        self.per, self.steps = per, steps
        self.ranks = [p["rank"] for p in per]
        self.by = [{r["step"]: r for r in p["records"]} for p in per]
        self.n, self.k = len(self.by), len(steps)
        self.comp = [[_net_compute(b[s]) for s in steps] for b in self.by]
        self.rows = [self._row(i) for i in range(self.n)]
        comp, n = self.comp, self.n
        self.excess = [[comp[i][j] / max(1e-12, _median([comp[q][j] for q in range(n) if q != i] or [comp[i][j]])) - 1
                        for j in range(self.k)] for i in range(n)]
        self.mean_ex = [_mean(e) for e in self.excess]
        self.slow = max(range(n), key=lambda i: self.mean_ex[i])
        self.others = [q for q in range(n) if q != self.slow]
        self.late = skew.lateness(self.by, steps)       # entry skew per rank and step (faults/skew.py)
        for i, row in enumerate(self.rows):
            row["late"] = _mean(self.late[i])
        self.step_t = _mean(r["step"] for r in self.rows)
        self.comm_t = _mean(r["comm"] + r["link"] for r in self.rows)

    def _row(self, i):
        """Rank i's seconds per step (mean over the steps): step, compute, wait, link,
        comm (the rest of the step), and its tokens."""
        rs = [self.by[i][s] for s in self.steps]
        step_t = _mean(sum(r[ph] for ph in PHASES) for r in rs)
        w, lk = _mean(_wait(r) for r in rs), _mean(r["link"] for r in rs)
        return {"rank": self.ranks[i], "step": step_t, "compute": _mean(self.comp[i]), "wait": w, "link": lk,
                "comm": max(0.0, step_t - _mean(self.comp[i]) - w - lk), "tokens": _mean(r["tokens"] for r in rs)}


def _cause(t, slow_steps, threshold):
    """Why the slow rank is slow on ``slow_steps``: (cause, why), or (None, None) when
    no signature fits. Uneven shard: slower where it holds more tokens (the median excess
    on its heavy steps above the median on the others by ``threshold``); throttled device:
    slow on (almost) every step; intermittent: some steps, same tokens, little comm."""
    ex, k = t.excess[t.slow], t.k
    tok = [t.by[t.slow][t.steps[j]]["tokens"] for j in range(k)]
    mid = 0.5 * (min(tok) + max(tok))
    heavy = [j for j in range(k) if tok[j] > mid] if max(tok) > 1.05 * min(tok) else []
    light = [j for j in range(k) if j not in heavy]
    # medians: one step disturbed by the shared cores must not hide (or fake) the split
    ex_heavy, ex_light = _median([ex[j] for j in heavy]), _median([ex[j] for j in light])
    if heavy and light and ex_heavy - ex_light > threshold:   # slow where it holds more tokens
        return "uneven shard", (
            f"slow on the {len(heavy)}/{k} steps where it holds {_mean(tok[j] for j in heavy) / _mean(tok[j] for j in light):.2f}x "
            f"the tokens ({1 + ex_heavy:.2f}x the others' compute there, {1 + ex_light:.2f}x elsewhere)")
    if len(slow_steps) / k >= 0.8:
        return "throttled device", f"slow in compute on {len(slow_steps)}/{k} steps, with the same tokens"
    if t.comm_t <= 0.3 * t.step_t and t.mean_ex[t.slow] > 2 * threshold:   # above the noise of shared cores
        return "intermittent", f"slow on {len(slow_steps)}/{k} steps, same tokens (contention? noise?)"
    return None, None


def _compute_straggler(t, threshold):
    """The report naming a rank slow in compute (its excess above ``threshold`` on its
    mean or on a quarter of the steps, with a cause), or None."""
    slow, others = t.slow, t.others
    slow_steps = [j for j in range(t.k) if t.excess[slow][j] > threshold]
    if not (t.n > 1 and slow_steps and (t.mean_ex[slow] > threshold or len(slow_steps) / t.k >= 0.25)):
        return None
    cause, why = _cause(t, slow_steps, threshold)
    if cause is None:
        return None
    extra = _mean(t.comp[slow][j] - _median([t.comp[q][j] for q in others]) for j in slow_steps)
    factor = 1 + _mean(t.excess[slow][j] for j in slow_steps)
    wait_ph = max(PHASES, key=lambda ph: _mean(t.by[q][s]["wait_" + ph] for q in others for s in t.steps))
    w_others = _mean(t.rows[q]["wait"] for q in others)
    text = (f"straggler: rank {t.ranks[slow]} ({cause}): its compute is {factor:.2f}x the others' median "
            f"(+{extra * 1e3:.1f} ms on its slow steps); {why}. The others wait for it "
            f"{w_others * 1e3:.1f} ms/step, mostly in {wait_ph}.")
    return Report(rank=t.ranks[slow], cause=cause, slowdown=factor, extra_s=extra, phase=wait_ph, link=None,
                  rows=t.rows, steps_slow=len(slow_steps), steps=t.k, text=text)


def straggler_report(source=None, group=None, last=32, skip=1, threshold=0.25):
    """Name the slow rank and tell the cause (module doc). ``source``: a model (or
    None): gather the last ``last`` steps of every rank (collective over ``group``);
    or a list (per rank) of gathered dicts / lists of records. The first ``skip``
    steps (warm-up) are dropped when more remain. ``threshold``: a rank whose compute
    exceeds the others' median by more than this fraction is a straggler."""
    per, steps = _align(source, group, last, skip)
    if not steps:
        return Report(rank=None, cause="no data", slowdown=1.0, extra_s=0.0, phase=None, link=None, rows=[],
                      text="no step recorded on every rank (run forward_backward first)")
    t = _Steps(per, steps)
    rep = _compute_straggler(t, threshold)
    if rep is None or rep.cause == "intermittent":   # phase times blurred by overlap: who arrives last?
        rep = skew.skew_straggler(t, threshold, Report) or rep
    if rep is None:   # nobody's compute stands out every step: is the step spent on the wire?
        rep = skew.slow_link(t, Report)
    if rep is None:
        worst = 1 + t.mean_ex[t.slow]
        rep = Report(rank=None, cause="balanced", slowdown=worst, extra_s=0.0, phase=None, link=None, rows=t.rows,
                     text=f"balanced: no rank's compute is more than {threshold:.0%} above the others' "
                          f"(max {worst:.2f}x, rank {t.ranks[t.slow]}).")
    return skew.on_nodes(rep, per)


def monitor(every=10, group=None, callback=None, last=None):
    """An ``on_step`` for ``pdist.training.train``: every ``every`` steps, one gather
    and a report (``callback(report)``, default: print it on rank 0)."""
    def on_step(step, loss):
        if (step + 1) % every:
            return
        rep = straggler_report(None, group=group, last=last or every)
        if callback is not None:
            callback(rep)
        else:
            from pdist import comm
            if comm.get_world().rank == 0:
                print(f"[debug] step {step}: {rep.text}", flush=True)
    return on_step


enable()

__all__ = ["straggler_report", "gather", "records", "clear", "monitor", "Report", "FIELDS", "enable",
           "disable"]
