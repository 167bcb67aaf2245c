"""Pipeline schedules as data: each stage's list of instructions, and the order its
messages are posted in.

A model cut into V = p*v consecutive *virtual stages* runs on p ranks; rank s
holds the v model chunks c = 0..v-1, chunk c being virtual stage k = c*p + s
(Megatron's interleaved assignment; v = 1 is the plain pipeline). A training
step over m micro-batches is, on every rank, a list of ``Instr``:

    FORWARD(mb, chunk)    BACKWARD(mb, chunk)          compute
    RECV_ACT / SEND_ACT   (mb, chunk, peer)            activations, k-1 -> k -> k+1
    RECV_GRAD / SEND_GRAD (mb, chunk, peer)            gradients,   k+1 -> k -> k-1
    OPTIMIZER_STEP                                     after every backward

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

Bubble (idle fraction of the step's makespan, t_b = 2 t_f, every stage equally
fast, communication free):  (p-1)/(m+p-1);  interleaved (p-1)/(v*m+p-1).

Blocking transports (a lone NCCL send once a message outgrows NCCL's buffers):
``rendezvous_batches`` is the order the executor posts each rank's messages in,
in batches (one NCCL group call each), with sends deferred until every send
meets its receive (``run_rendezvous``; ``simulate.simulate_rendezvous`` checks it).
"""
from collections import namedtuple

FORWARD, BACKWARD = "FORWARD", "BACKWARD"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
OPTIMIZER_STEP = "OPTIMIZER_STEP"
COMPUTE = (FORWARD, BACKWARD)
COMM = (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD)


class Instr(namedtuple("Instr", ["op", "mb", "chunk", "peer"])):
    """One step of a stage's program; ``peer`` is the pp rank sent to / received from."""
    __slots__ = ()

    def __new__(cls, op, mb=None, chunk=0, peer=None):
        return super().__new__(cls, op, mb, chunk, peer)

    def __repr__(self):
        if self.op == OPTIMIZER_STEP:
            return "STEP"
        peer = "" if self.peer is None else f"->{self.peer}" if self.op.startswith("SEND") else f"<-{self.peer}"
        return f"{self.op}({self.mb}.{self.chunk}{peer})"


def virtual_stage(chunk, p, s):
    """k = chunk * p + s: the model chunk ``chunk`` of pp rank s is virtual stage k."""
    return chunk * p + s


class DeadlockError(RuntimeError):
    pass


def _check_args(p, m, v=1):
    for name, val in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"schedule: {name} must be a positive integer, got {val!r}")


def _program(p, s, v, order):
    """Expand a compute order [(op, mb, chunk)] of rank s into instructions, with
    each receive right before the compute that needs it and each send right after
    the compute that produced it."""
    V, prog = p * v, []
    for op, mb, c in order:
        k = virtual_stage(c, p, s)
        if op == FORWARD:
            if k > 0:
                prog.append(Instr(RECV_ACT, mb, c, (k - 1) % p))
            prog.append(Instr(FORWARD, mb, c))
            if k < V - 1:
                prog.append(Instr(SEND_ACT, mb, c, (k + 1) % p))
        else:
            if k < V - 1:
                prog.append(Instr(RECV_GRAD, mb, c, (k + 1) % p))
            prog.append(Instr(BACKWARD, mb, c))
            if k > 0:
                prog.append(Instr(SEND_GRAD, mb, c, (k - 1) % p))
    prog.append(Instr(OPTIMIZER_STEP))
    return prog


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


SCHEDULES = {"gpipe": lambda p, m, v=1: gpipe(p, m), "1f1b": lambda p, m, v=1: one_f_one_b(p, m),
             "interleaved": interleaved_1f1b}


def make_schedule(name, p, m, v=1):
    """``name`` in gpipe, 1f1b, interleaved -> list (one per stage) of instruction lists."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name != "interleaved" and v != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank (v=1), got v={v}; "
                         f"use schedule='interleaved' for v > 1")
    return SCHEDULES[name](p, m, v)


# ------------------------------------------------------------------ messages
def message_key(s, ins, p):
    """What identifies a message: (kind, mb, receiving virtual stage)."""
    k = virtual_stage(ins.chunk, p, s)
    if ins.op == SEND_ACT:
        return ("act", ins.mb, k + 1), (ins.peer, (k + 1) // p)
    if ins.op == RECV_ACT:
        return ("act", ins.mb, k), (s, ins.chunk)
    if ins.op == SEND_GRAD:
        return ("grad", ins.mb, k - 1), (ins.peer, (k - 1) // p)
    return ("grad", ins.mb, k), (s, ins.chunk)


# ------------------------------------------------- blocking (rendezvous) transports
def comm_batches(program):
    """Each run of SEND/RECV instructions between two computes, posted together right
    before the compute (or OPTIMIZER_STEP) that follows it: [(anchor, [Instr])], anchor =
    the index in ``program`` of that compute. Empty runs left out."""
    out, cur = [], []
    for j, ins in enumerate(program):
        if ins.op in COMM:
            cur.append(ins)
        elif cur:
            out.append((j, cur))
            cur = []
    if cur:
        out.append((len(program), cur))
    return out


def run_rendezvous(batches):
    """Run [(anchor, [Instr])] per rank with blocking sends and receives: a batch completes
    once each of its operations has met its partner in the partner's posted batch.
    Returns None when all finish, else {rank: index of its stuck batch}."""
    p = len(batches)
    pos, done, local = [0] * p, set(), set()
    while True:
        posted = {}
        for s in range(p):
            if pos[s] < len(batches[s]):
                for ins in batches[s][pos[s]][1]:
                    posted[(message_key(s, ins, p)[0], ins.op.startswith("SEND"))] = s
        progressed = False
        for s in range(p):
            if pos[s] >= len(batches[s]):
                continue
            ok = True
            for ins in batches[s][pos[s]][1]:
                msg, is_send = message_key(s, ins, p)[0], ins.op.startswith("SEND")
                if ins.peer == s:                       # a message to itself: a local copy
                    if is_send:
                        local.add(msg)
                    elif msg not in local:
                        raise DeadlockError(f"rank {s}: {ins} receives from itself before its send")
                elif (msg, is_send) in done:
                    pass
                elif posted.get((msg, not is_send)) == ins.peer:
                    done.update({(msg, True), (msg, False)})
                else:
                    ok = False
            if ok:
                pos[s] += 1
                progressed = True
        if all(pos[s] >= len(batches[s]) for s in range(p)):
            return None
        if not progressed:
            return {s: pos[s] for s in range(p) if pos[s] < len(batches[s])}


def rendezvous_batches(schedule):
    """The order the executor posts messages in, per rank [(anchor, [Instr])]: the batches
    of ``comm_batches`` (one NCCL group call each, before the compute at ``anchor``), where a
    send that would block on a receive its peer posts only later is deferred to the rank's
    next batch, until ``run_rendezvous`` finishes. Deferring a send is always legal
    (its data is ready; only its departure moves). Deterministic: every rank computes the
    same plan."""
    plan = [[(a, list(b)) for a, b in comm_batches(prog)] for prog in schedule]
    p = len(schedule)
    for _ in range(10 * sum(len(prog) for prog in schedule) + 10):
        stuck = run_rendezvous(plan)
        if stuck is None:
            return plan
        posted = {}
        for s, b in stuck.items():
            for ins in plan[s][b][1]:
                posted[(message_key(s, ins, p)[0], ins.op.startswith("SEND"))] = s
        moved = False
        for s, b in stuck.items():
            if b + 1 >= len(plan[s]):
                continue
            late = [i for i in plan[s][b][1] if i.op.startswith("SEND") and i.peer != s
                    and posted.get((message_key(s, i, p)[0], False)) != i.peer]
            if late:
                plan[s][b] = (plan[s][b][0], [i for i in plan[s][b][1] if i not in late])
                plan[s][b + 1] = (plan[s][b + 1][0], late + plan[s][b + 1][1])
                moved = True
        plan = [[(a, b) for a, b in rank if b] for rank in plan]
        if not moved:
            break
    raise DeadlockError("pipeline messages deadlock with blocking sends, even with sends deferred: "
                        + ", ".join(f"rank {s} at {plan[s][b][1]!r}" for s, b in (run_rendezvous(plan) or {}).items()))
