"""Pipeline schedules as data: each stage's list of instructions, and a checker.

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
these semantics a schedule is deadlock-free iff ``simulate`` finishes it.

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
"""
from collections import namedtuple

FORWARD, BACKWARD = "FORWARD", "BACKWARD"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
OPTIMIZER_STEP = "OPTIMIZER_STEP"
COMPUTE = (FORWARD, BACKWARD)


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


# ------------------------------------------------------------------ checking
def _msg_key(s, ins, p):
    """What identifies a message: (kind, mb, receiving virtual stage)."""
    k = virtual_stage(ins.chunk, p, s)
    if ins.op == SEND_ACT:
        return ("act", ins.mb, k + 1), (ins.peer, (k + 1) // p)
    if ins.op == RECV_ACT:
        return ("act", ins.mb, k), (s, ins.chunk)
    if ins.op == SEND_GRAD:
        return ("grad", ins.mb, k - 1), (ins.peer, (k - 1) // p)
    return ("grad", ins.mb, k), (s, ins.chunk)


def simulate(schedule, t_f=1.0, t_b=2.0, t_comm=0.0):
    """Run the programs without communication: each rank executes in order; a
    compute waits for the message it consumes (sent t_comm earlier), sends cost
    nothing. Returns per rank a list of (Instr, start, end) for the computes.
    Raises DeadlockError naming each rank's stuck instruction."""
    p = len(schedule)
    V = p * _chunks(schedule)
    sent, pos, clock = {}, [0] * p, [0.0] * p
    posted = [dict() for _ in range(p)]     # key -> True for receives posted on this rank
    spans = [[] for _ in range(p)]
    while True:
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                ins = schedule[s][pos[s]]
                if ins.op in (SEND_ACT, SEND_GRAD):
                    sent[_msg_key(s, ins, p)[0]] = clock[s]
                elif ins.op in (RECV_ACT, RECV_GRAD):
                    posted[s][_msg_key(s, ins, p)[0]] = True
                elif ins.op in COMPUTE:
                    k = virtual_stage(ins.chunk, p, s)
                    need = None
                    if ins.op == FORWARD and k > 0:
                        need = ("act", ins.mb, k)
                    elif ins.op == BACKWARD and k < V - 1:
                        need = ("grad", ins.mb, k)
                    if need is not None:
                        if need not in posted[s]:
                            raise DeadlockError(f"rank {s}: {ins} consumes {need} that no RECV posted before it")
                        if need not in sent:
                            break                              # blocked until the peer sends
                        clock[s] = max(clock[s], sent[need] + t_comm)
                    t0 = clock[s]
                    clock[s] += t_f if ins.op == FORWARD else t_b
                    spans[s].append((ins, t0, clock[s]))
                pos[s] += 1
                progressed = True
        if all(pos[s] == len(schedule[s]) for s in range(p)):
            return spans
        if not progressed:
            stuck = ", ".join(f"rank {s} at {schedule[s][pos[s]]!r}" for s in range(p) if pos[s] < len(schedule[s]))
            raise DeadlockError(f"pipeline schedule deadlocks: {stuck}")


def _chunks(schedule):
    return 1 + max((i.chunk for prog in schedule for i in prog if i.op in COMPUTE), default=0)


def check_schedule(schedule, m):
    """Verify a schedule without communication; returns the peak stash per rank.

    * every (mb, chunk) has exactly one FORWARD and one BACKWARD on each rank,
      the BACKWARD after the FORWARD, and OPTIMIZER_STEP last, after every backward;
    * every send has exactly one matching receive (same kind, micro-batch and
      virtual stage, the right peer), every receive one send, and each RECV comes
      before the compute that consumes it, each SEND after the compute that
      produced it;
    * ``simulate`` finishes (no deadlock).
    Peak stash: most (mb, chunk) forwarded but not yet backwarded at once."""
    p, v = len(schedule), _chunks(schedule)
    sends, recvs, peaks = {}, {}, []
    for s, prog in enumerate(schedule):
        done_f, done_b, live, peak = set(), set(), 0, 0
        if not prog or prog[-1].op != OPTIMIZER_STEP or sum(i.op == OPTIMIZER_STEP for i in prog) != 1:
            raise AssertionError(f"rank {s}: the program must end with exactly one OPTIMIZER_STEP")
        for ins in prog:
            key = (ins.mb, ins.chunk)
            if ins.op == FORWARD:
                assert key not in done_f, f"rank {s}: {ins} runs twice"
                done_f.add(key)
                live += 1
                peak = max(peak, live)
            elif ins.op == BACKWARD:
                assert key in done_f, f"rank {s}: {ins} runs before its forward"
                assert key not in done_b, f"rank {s}: {ins} runs twice"
                done_b.add(key)
                live -= 1
            elif ins.op in (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD):
                msg, dest = _msg_key(s, ins, p)
                table = sends if ins.op.startswith("SEND") else recvs
                assert msg not in table, f"rank {s}: {ins} duplicates a message {msg}"
                table[msg] = (s, dest, ins)
                if ins.op == SEND_ACT:
                    assert key in done_f, f"rank {s}: {ins} before its FORWARD"
                elif ins.op == SEND_GRAD:
                    assert key in done_b, f"rank {s}: {ins} before its BACKWARD"
                elif ins.op == RECV_ACT:
                    assert key not in done_f, f"rank {s}: {ins} after the FORWARD that needs it"
                else:
                    assert key not in done_b, f"rank {s}: {ins} after the BACKWARD that needs it"
        want = {(mb, c) for mb in range(m) for c in range(v)}
        assert done_f == want and done_b == want, (
            f"rank {s}: forwards {sorted(want - done_f)} / backwards {sorted(want - done_b)} missing")
        peaks.append(peak)
    for msg, (s, dest, ins) in sends.items():
        assert msg in recvs, f"rank {s}: {ins} has no matching receive ({msg})"
        r, _, rins = recvs[msg]
        assert (r, rins.chunk) == dest and rins.peer == s, f"{ins} on rank {s} does not match {rins} on rank {r}"
    for msg, (r, _, rins) in recvs.items():
        assert msg in sends, f"rank {r}: {rins} has no matching send ({msg})"
    simulate(schedule)
    return peaks


def bubble_fraction(spans, t_end=None):
    """Idle fraction of each rank: 1 - (time in FORWARD/BACKWARD) / makespan, the
    makespan running from 0 to the last compute's end on any rank (or t_end).
    Spans of other kinds (a measured timeline's WAITs) count as idle."""
    spans = [[(i, s, e) for i, s, e in rank if i.op in COMPUTE] for rank in spans]
    end = t_end if t_end is not None else max(e for rank in spans for _, _, e in rank)
    return [1.0 - sum(e - s for _, s, e in rank) / end for rank in spans]


def theoretical_bubble(p, m, v=1):
    """(p-1)/(v m + p-1): idle share of the makespan with uniform stages, t_b = 2 t_f
    (any fixed ratio gives the same) and free communication. Interleaved (v > 1)
    reaches it when p divides m; for m < p it returns None (no closed form: the
    groups of p micro-batches never fill -- ``simulate`` gives the planned value)."""
    if v > 1 and m % p:
        return None
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------- blocking (rendezvous) transports
_COMM = (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD)


def comm_batches(program):
    """Each run of SEND/RECV instructions between two computes, posted together right
    before the compute (or OPTIMIZER_STEP) that follows it: [(anchor, [Instr])], anchor =
    the index in ``program`` of that compute. Empty runs left out."""
    out, cur = [], []
    for j, ins in enumerate(program):
        if ins.op in _COMM:
            cur.append(ins)
        elif cur:
            out.append((j, cur))
            cur = []
    if cur:
        out.append((len(program), cur))
    return out


def _rendezvous(batches):
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
                    posted[(_msg_key(s, ins, p)[0], ins.op.startswith("SEND"))] = s
        progressed = False
        for s in range(p):
            if pos[s] >= len(batches[s]):
                continue
            ok = True
            for ins in batches[s][pos[s]][1]:
                msg, is_send = _msg_key(s, ins, p)[0], ins.op.startswith("SEND")
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
    next batch, until ``simulate_rendezvous`` finishes. Deferring a send is always legal
    (its data is ready; only its departure moves). Deterministic: every rank computes the
    same plan."""
    plan = [[(a, list(b)) for a, b in comm_batches(prog)] for prog in schedule]
    p = len(schedule)
    for _ in range(10 * sum(len(prog) for prog in schedule) + 10):
        stuck = _rendezvous(plan)
        if stuck is None:
            return plan
        posted = {}
        for s, b in stuck.items():
            for ins in plan[s][b][1]:
                posted[(_msg_key(s, ins, p)[0], ins.op.startswith("SEND"))] = s
        moved = False
        for s, b in stuck.items():
            if b + 1 >= len(plan[s]):
                continue
            late = [i for i in plan[s][b][1] if i.op.startswith("SEND") and i.peer != s
                    and posted.get((_msg_key(s, i, p)[0], False)) != i.peer]
            if late:
                plan[s][b] = (plan[s][b][0], [i for i in plan[s][b][1] if i not in late])
                plan[s][b + 1] = (plan[s][b + 1][0], late + plan[s][b + 1][1])
                moved = True
        plan = [[(a, b) for a, b in rank if b] for rank in plan]
        if not moved:
            break
    raise DeadlockError("pipeline messages deadlock with blocking sends, even with sends deferred: "
                        + ", ".join(f"rank {s} at {plan[s][b][1]!r}" for s, b in (_rendezvous(plan) or {}).items()))


def simulate_rendezvous(schedule, plan=None):
    """Check a message order under the harshest transport: every send and every receive
    blocks its rank until the peer has posted the matching operation (a lone NCCL
    send/recv once a message outgrows NCCL's buffers). ``plan`` per rank [(anchor,
    [Instr])] (default: ``rendezvous_batches``, what the executor posts; ``"program"``:
    each message alone in program order). The operations of one batch are posted
    together (an NCCL group call). Raises DeadlockError naming each stuck rank's batch."""
    if plan is None:
        plan = rendezvous_batches(schedule)
    elif plan == "program":
        plan = [[(j, [i]) for j, i in enumerate(prog) if i.op in _COMM] for prog in schedule]
    stuck = _rendezvous(plan)
    if stuck:
        raise DeadlockError("pipeline messages deadlock with blocking sends: " +
                            ", ".join(f"rank {s} at {plan[s][b][1]!r}" for s, b in stuck.items()))
