"""Pipeline schedules as data: each stage's list of instructions, and the order its
messages are posted in.

A training step over m micro-batches is, on every rank, a list of ``Instr``
(instructions.py: the ops FORWARD, BACKWARD, BACKWARD_INPUT "B", BACKWARD_WEIGHT "W",
SEND/RECV of activations and gradients, OPTIMIZER_STEP; the placement of the chunks,
"loop" k = c*p + s or "v"). ``make_schedule`` returns a ``Schedule``: the list of
programs carrying its ``.placement``.

Sends are non-blocking (posted and forgotten until the step ends); a RECV posts
a non-blocking receive that the consuming FORWARD/BACKWARD waits on. Under
these semantics a schedule is deadlock-free iff ``simulate`` finishes it
(simulate.py: the timeline, the checker, the bubble).

* ``gpipe(p, m)`` -- GPipe (Huang et al., 2019): all m forwards, then all m
  backwards. Stash: m micro-batches of activations on every stage.
* ``one_f_one_b(p, m)`` -- PipeDream-flush / 1F1B (Narayanan et al., 2021):
  stage s runs min(p-s-1, m) warm-up forwards, then alternates one forward and
  one backward, then drains. Same bubble as GPipe, stash <= p - s.
* ``interleaved_1f1b(p, m, v)`` -- interleaved 1F1B (Narayanan et al., 2021,
  sec. 2.2): v chunks per rank, micro-batches walk the chunks in groups of p;
  the bubble shrinks by v, the stash grows (counted in chunk-activations).
* ``zb-h1``, ``zb-v``, ``dualpipev`` -- zero-bubble schedules with the backward
  split into B and W (zero_bubble.py; their bubble formulas are there).

Bubble (idle fraction of the step's makespan, t_b = 2 t_f, every stage equally
fast, communication free):  (p-1)/(m+p-1);  interleaved (p-1)/(v*m+p-1).

Blocking transports (a lone NCCL send once a message outgrows NCCL's buffers):
``rendezvous_batches`` (rendezvous.py) is the order the executor posts each rank's
messages in, in batches (one NCCL group call each), with sends deferred until every
send meets its receive (``run_rendezvous``; ``simulate.simulate_rendezvous`` checks it).
"""
from pdist.parallel.pipeline.instructions import (  # noqa: F401  (the vocabulary, re-exported)
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMM, COMPUTE, FORWARD, OPTIMIZER_STEP, PLACEMENTS, RECV_ACT,
    RECV_GRAD, SEND_ACT, SEND_GRAD, V_SHAPED, DeadlockError, Instr, Schedule, message_key, placement_of,
    _check_args, _program, schedule_placement, stage_owner, virtual_stage)
from pdist.parallel.pipeline import zero_bubble as zb
from pdist.parallel.pipeline.rendezvous import (  # noqa: F401  (re-exported: the executor's message order)
    comm_batches, matched_batches, rendezvous_batches, run_rendezvous)


def gpipe(p, m):
    """GPipe: F_0 .. F_{m-1}, then B_0 .. B_{m-1}, on every stage."""
    _check_args(p, m)
    return [_program(p, s, 1, [(FORWARD, i, 0) for i in range(m)] + [(BACKWARD, i, 0) for i in range(m)])
            for s in range(p)]


def one_f_one_b(p, m):
    """1F1B: warm-up min(p-s-1, m) forwards, steady (F_{w+i}, B_i), cool-down backwards."""
    _check_args(p, m)
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [(FORWARD, i, 0) for i in range(warm)]
        for i in range(m - warm):
            order += [(FORWARD, warm + i, 0), (BACKWARD, i, 0)]
        order += [(BACKWARD, i, 0) for i in range(m - warm, m)]
        out.append(_program(p, s, 1, order))
    return out


def _interleaved_order(p, m, v, backward):
    """The (mb, chunk) order of interleaved forwards (or backwards): micro-batches
    in groups of p (the last group may be smaller), each group through chunk 0..v-1
    (backward: v-1..0)."""
    order = []
    for g0 in range(0, m, p):
        group = range(g0, min(g0 + p, m))
        for c in (reversed(range(v)) if backward else range(v)):
            order += [(mb, c) for mb in group]
    return order


def interleaved_1f1b(p, m, v):
    """Interleaved 1F1B (Megatron's virtual pipeline): warm-up of
    min(2(p-s-1) + (v-1)p, m v) chunk-forwards, then 1F1B over (mb, chunk)."""
    _check_args(p, m, v)
    if m > p and m % p:
        raise ValueError(f"interleaved 1F1B needs the micro-batch count m to be a multiple of the "
                         f"pipeline size p (or m <= p), got m={m}, p={p}: use m={m - m % p} or {m + p - m % p}")
    fwd, bwd = _interleaved_order(p, m, v, False), _interleaved_order(p, m, v, True)
    total, out = m * v, []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        order = [(FORWARD, *fwd[i]) for i in range(warm)]
        for i in range(total - warm):
            order += [(FORWARD, *fwd[warm + i]), (BACKWARD, *bwd[i])]
        order += [(BACKWARD, *bwd[i]) for i in range(total - warm, total)]
        out.append(_program(p, s, v, order))
    return out


SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")


def make_schedule(name, p, m, v=None):
    """``name`` in SCHEDULE_NAMES -> ``Schedule`` (one instruction list per pp rank, with its
    ``.placement``). ``v`` chunks per rank: interleaved any (None -> 1), zb-v and dualpipev
    exactly 2 (None -> 2), the others 1."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {list(SCHEDULE_NAMES)}")
    need = 2 if name in V_SHAPED else 1
    v = need if v is None else v
    if name in V_SHAPED and v != 2:
        raise ValueError(f"schedule {name!r} runs two chunks per rank in a V (v=2, chunks=2), got v={v}; "
                         "pass v=2 (or None)")
    if name != "interleaved" and v != 1 and name not in V_SHAPED:
        raise ValueError(f"schedule {name!r} runs one chunk per rank (v=1), got v={v}; "
                         f"use schedule='interleaved' for v > 1")
    build = {"gpipe": lambda: gpipe(p, m), "1f1b": lambda: one_f_one_b(p, m),
             "interleaved": lambda: interleaved_1f1b(p, m, v), "zb-h1": lambda: zb.zb_h1(p, m),
             "zb-v": lambda: zb.zb_v(p, m), "dualpipev": lambda: zb.dualpipev(p, m)}[name]
    return Schedule(build(), placement_of(name), name)
