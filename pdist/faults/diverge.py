"""Where two runs part: the divergence bisector over fingerprinted runs (docs/divergence.md).

Two runs recorded with ``pdist.measure.fingerprint.record`` (any layouts, any world sizes):

    d = diverge("runs/dp4", "runs/tp2")          # or: python -m pdist.debug diverge RUN_A RUN_B
    print(d)       # step 3, fwd op h.0.mlp.c_fc out, rank 1 of B, rel diff 2.1e-07 > rtol 1e-09
    d.step, d.phase, d.op, d.tensor, d.rank, d.rel_diff

Each run's ranks are joined per (step, phase, op, tensor) into the full tensor's fingerprint
(pdist/measure/fingerprint.py: replicas count once, pieces add). The steps are walked in
order; inside a step, the forward ops in forward order, then the backward's dL/d(out) in the
order backward reached them, then the synchronized parameter gradients. The first tensor whose
fingerprints differ is the divergence:

    exact   (rtol = 0): the bit sums b1, b2 differ (or the element counts); the default when
            both runs were recorded in the deterministic mode, where the bits must be equal;
    else    rel_diff = max(|d norm| / norm, |d max| / max, |d sum| / (sqrt(n) norm)) > rtol,
            rtol by default 1e-9 in float64 (the project's equivalence), 1e-5 in float32 and
            1e-2 in bf16/fp16 (a few ulps after a reduction in another order grow with steps).

``rank``: with the two runs on the same layout (the same strategies, group sizes and ranks),
the first rank whose own fingerprint of that tensor differs; otherwise None (``ranks_b``: the
ranks of B holding it).
"""
import json
import math
import os
from dataclasses import dataclass, field

from pdist.measure.fingerprint import FORMAT, combine

PHASES = ("fwd", "bwd", "grad")
RTOL = {"float64": 1e-9, "float32": 1e-5}
RTOL_LOW = 1e-2


class RunDirError(ValueError):
    """A run directory that is missing, not a fingerprinted run, or not comparable."""


@dataclass
class Divergence:
    """The first place two runs part (module doc); ``step`` None: no divergence."""
    step: int = None
    phase: str = None
    op: str = None
    tensor: str = None
    rank: int = None
    rel_diff: float = 0.0
    rtol: float = 0.0
    exact: bool = False
    a: list = None                 # the two joined fingerprints (n, ss, mx, s, b1, b2)
    b: list = None
    ranks_b: list = field(default_factory=list)
    steps_compared: int = 0
    tensors_compared: int = 0
    only_in_a: int = 0
    only_in_b: int = 0

    @property
    def found(self):
        return self.step is not None

    def __str__(self):
        how = "identical bits" if self.exact else f"rel diff <= rtol {self.rtol:g}"
        if not self.found:
            return (f"no divergence: {self.tensors_compared} tensors over {self.steps_compared} steps agree "
                    f"({how})")
        where = f"rank {self.rank}" if self.rank is not None else f"ranks {self.ranks_b} of B"
        by = f"rel diff {self.rel_diff:.3g}" + (" (bits differ)" if self.exact else f" > rtol {self.rtol:g}")
        return f"runs part at step {self.step}, {self.phase} op {self.op} tensor {self.tensor}, {where}: {by}"


def load(run_dir):
    """(meta, {rank: {step: {(phase, op, tensor): fingerprint}}}, {rank: {step: [keys in order]}})."""
    meta_path = os.path.join(run_dir, "meta.json")
    if not os.path.isdir(run_dir):
        raise RunDirError(f"diverge: {run_dir!r} is not a directory; pass the run_dir given to "
                          "pdist.measure.fingerprint.record")
    if not os.path.isfile(meta_path):
        raise RunDirError(f"diverge: {run_dir!r} holds no meta.json: not a fingerprinted run (record it with "
                          "pdist.measure.fingerprint.record(model, run_dir))")
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
    except ValueError as e:
        raise RunDirError(f"diverge: {meta_path} is not valid JSON ({e}); record the run again") from None
    if meta.get("format") != FORMAT:
        raise RunDirError(f"diverge: {meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    ranks, order = {}, {}
    for r in range(int(meta["world_size"])):
        ranks[r], order[r] = _load_rank(run_dir, r, meta["world_size"])
    return meta, ranks, order


def _load_rank(run_dir, r, world):
    path = os.path.join(run_dir, f"rank-{r}.jsonl")
    if not os.path.isfile(path):
        raise RunDirError(f"diverge: {path} is missing: the run had {world} ranks and each writes its file; "
                          "did rank {r} fail before its first step?".replace("{r}", str(r)))
    steps, order = {}, {}
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            try:
                rec = json.loads(line)
                step = int(rec["step"])
                steps[step] = {tuple(x[:3]): x[3:] for x in rec["records"]}
                order[step] = [tuple(x[:3]) for x in rec["records"]]
            except (ValueError, KeyError, TypeError) as e:
                raise RunDirError(f"diverge: {path} line {i} is not a fingerprint record ({e!r})") from None
    return steps, order


def join(ranks, step, key):
    """The full tensor's fingerprint from the ranks' (replicas once, pieces added), and the
    ranks holding it."""
    held = [(r, tuple(s[step][key])) for r, s in sorted(ranks.items()) if step in s and key in s[step]]
    distinct = list(dict.fromkeys(f for _, f in held))
    return combine(distinct), [r for r, _ in held]


def rel_diff(fa, fb):
    """max(|d norm| / norm, |d max| / max, |d sum| / (sqrt(n) norm)); inf when the counts differ."""
    if fa[0] != fb[0]:
        return math.inf
    na, nb = math.sqrt(fa[1]), math.sqrt(fb[1])
    norm, mx = max(na, nb), max(fa[2], fb[2])
    if norm == 0.0:
        return 0.0
    return max(abs(na - nb) / norm, abs(fa[2] - fb[2]) / mx if mx else 0.0,
               abs(fa[3] - fb[3]) / (math.sqrt(fa[0]) * norm))


def _differs(fa, fb, rtol):
    if rtol == 0:
        return fa[0] != fb[0] or fa[4:] != fb[4:]
    return rel_diff(fa, fb) > rtol


def _default_rtol(ma, mb):
    if ma.get("deterministic") and mb.get("deterministic"):
        return 0.0
    dts = {ma.get("dtype"), mb.get("dtype")}
    return max(RTOL.get(d, RTOL_LOW) for d in dts if d) if any(dts) else RTOL["float64"]


def _keys_in_order(order, step):
    """The step's keys: phase by phase, each in the order first seen on the lowest rank."""
    seen = {}
    for r in sorted(order):
        for i, k in enumerate(order[r].get(step, ())):
            seen.setdefault(k, (i, r))
    return sorted(seen, key=lambda k: (PHASES.index(k[0]), seen[k]))


def diverge(run_a, run_b, rtol=None):
    """The first ``Divergence`` of run_b from run_a (module doc); ``rtol``: None = the default
    (exact in the deterministic mode, else by dtype), 0 = identical bits."""
    ma, ra, oa = load(run_a)
    mb, rb, ob = load(run_b)
    rtol = _default_rtol(ma, mb) if rtol is None else float(rtol)
    if rtol < 0:
        raise ValueError(f"diverge: rtol must be >= 0 (0: identical bits), got {rtol}")
    steps = sorted(set().union(*(s.keys() for s in ra.values())) & set().union(*(s.keys() for s in rb.values())))
    if not steps:
        raise RunDirError(f"diverge: {run_a!r} and {run_b!r} share no recorded step; record the same steps")
    out = Divergence(rtol=rtol, exact=rtol == 0)
    keys_b = {}
    for step in steps:
        kb = set(_keys_in_order(ob, step))
        keys_b[step] = kb
        for key in _keys_in_order(oa, step):
            if key not in kb:
                out.only_in_a += 1
                continue
            fa, _ = join(ra, step, key)
            fb, held = join(rb, step, key)
            out.tensors_compared += 1
            if _differs(fa, fb, rtol):
                same = ma.get("layout") == mb.get("layout") and len(ra) == len(rb)
                return _found(out, step, key, fa, fb, held, ra, rb, rtol, same)
        out.steps_compared += 1
        out.only_in_b += len(kb - set(_keys_in_order(oa, step)))
    if not out.tensors_compared:
        raise RunDirError(f"diverge: {run_a!r} and {run_b!r} share no tensor name in {len(steps)} common steps: "
                          "runs of different models? (names are single-process module paths)")
    return out


def drift(run_a, run_b):
    """Per common step: (step, tensors with identical bits, tensors compared, the largest
    rel_diff, the (phase, op, tensor) where it is): how two runs drift apart step by step."""
    ma, ra, oa = load(run_a)
    mb, rb, ob = load(run_b)
    rows = []
    for step in sorted(set(ra[0]) & set(rb[0])):
        kb, same, n, worst = set(_keys_in_order(ob, step)), 0, 0, (0.0, None)
        for key in _keys_in_order(oa, step):
            if key in kb:
                fa, fb = join(ra, step, key)[0], join(rb, step, key)[0]
                n, same = n + 1, same + (not _differs(fa, fb, 0))
                worst = max(worst, (rel_diff(fa, fb), key), key=lambda w: w[0])
        rows.append((step, same, n, *worst))
    return rows


def _found(out, step, key, fa, fb, held, ra, rb, rtol, same_layout):
    out.step, (out.phase, out.op, out.tensor) = step, key
    out.a, out.b, out.ranks_b, out.rel_diff = fa, fb, held, rel_diff(fa, fb)
    if same_layout:
        for r in sorted(rb):
            pa, pb = ra[r].get(step, {}).get(key), rb[r].get(step, {}).get(key)
            if pa is not None and pb is not None and _differs(pa, pb, rtol):
                out.rank = r
                break
    return out


__all__ = ["diverge", "drift", "Divergence", "RunDirError", "load", "join", "rel_diff", "RTOL"]
