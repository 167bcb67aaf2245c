"""Pipeline schedules run on paper: the timeline, the checker and the bubble.

``simulate`` runs every rank's program without communication (a compute waits
for the message it consumes; sends cost nothing), so a schedule is deadlock-free
under non-blocking sends iff it finishes. ``check_schedule`` checks a schedule's
structure (one FORWARD per micro-batch and chunk and one BACKWARD, or one B then
one W; matched messages in the right places) and returns each rank's peak stash.
``bubble_fraction`` measures the idle share of a timeline (simulated or
measured); ``theoretical_bubble`` is the papers' formula (zero_bubble.py lists them).
``simulate_rendezvous`` checks a message order under blocking sends.
"""
from pdist.parallel.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMM, COMPUTE, FORWARD,
                                               OPTIMIZER_STEP, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                               DeadlockError, message_key, rendezvous_batches, run_rendezvous,
                                               schedule_placement, virtual_stage)


def simulate(schedule, t_f=1.0, t_b=2.0, t_comm=0.0, t_w=None):
    """Run the programs without communication: each rank executes in order; a
    compute waits for the message it consumes (sent t_comm earlier), sends cost
    nothing. Costs: FORWARD t_f, BACKWARD (the whole backward) t_b, and split,
    BACKWARD_WEIGHT t_w (default t_b / 2) and BACKWARD_INPUT t_b - t_w -- so the
    defaults are the zero-bubble paper's t_F = t_B = t_W = 1 (and 1F1B's t_b = 2 t_f).
    Returns per rank a list of (Instr, start, end) for the computes.
    Raises DeadlockError naming each rank's stuck instruction."""
    p, where = len(schedule), schedule_placement(schedule)
    V = p * _chunks(schedule)
    t_w = t_b / 2 if t_w is None else t_w
    cost = {FORWARD: t_f, BACKWARD: t_b, BACKWARD_INPUT: t_b - t_w, BACKWARD_WEIGHT: t_w}
    sent, pos, clock = {}, [0] * p, [0.0] * p
    posted = [dict() for _ in range(p)]     # key -> True for receives posted on this rank
    spans = [[] for _ in range(p)]
    while True:
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                ins = schedule[s][pos[s]]
                if ins.op in (SEND_ACT, SEND_GRAD):
                    sent[message_key(s, ins, p, where)[0]] = clock[s]
                elif ins.op in (RECV_ACT, RECV_GRAD):
                    posted[s][message_key(s, ins, p, where)[0]] = True
                elif ins.op in COMPUTE:
                    k = virtual_stage(ins.chunk, p, s, where)
                    need = None
                    if ins.op == FORWARD and k > 0:
                        need = ("act", ins.mb, k)
                    elif ins.op in (BACKWARD, BACKWARD_INPUT) and k < V - 1:
                        need = ("grad", ins.mb, k)
                    if need is not None:
                        if need not in posted[s]:
                            raise DeadlockError(f"rank {s}: {ins} consumes {need} that no RECV posted before it")
                        if need not in sent:
                            break                              # blocked until the peer sends
                        clock[s] = max(clock[s], sent[need] + t_comm)
                    t0 = clock[s]
                    clock[s] += cost[ins.op]
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


def _check_compute(s, ins, seen, unsent):
    """One compute of rank s against what ran before it; returns the change of its stash.
    ``seen[op]``: the (mb, chunk) that ran it; ``unsent``: B's whose SEND_GRAD is still due."""
    key, f, bw = (ins.mb, ins.chunk), seen[FORWARD], seen[BACKWARD]
    assert not unsent, (f"rank {s}: {ins} runs between a B and its SEND_GRAD {sorted(unsent)}: the previous "
                        "stage's B would wait on it; send the gradient right after its B (BACKWARD_INPUT)")
    assert key not in seen[ins.op] and not (ins.op in (BACKWARD, BACKWARD_INPUT) and key in bw), (
        f"rank {s}: {ins} runs twice (each (mb, chunk) has one BACKWARD, or one B then one W)")
    if ins.op == FORWARD:
        f.add(key)
        return 1
    if ins.op == BACKWARD_WEIGHT:
        assert key in seen[BACKWARD_INPUT], f"rank {s}: {ins} (a W) runs before its B (BACKWARD_INPUT)"
        seen[BACKWARD_WEIGHT].add(key)
        return -1                                    # the stash stays until W: W reads it
    assert key in f, f"rank {s}: {ins} runs before its forward"
    seen[ins.op].add(key)
    bw.add(key)
    return -1 if ins.op == BACKWARD else 0


def _check_rank(s, prog, p, v, where, m, sends, recvs):
    """The per-rank rules of ``check_schedule``; returns the rank's peak stash."""
    seen = {op: set() for op in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)}
    live = peak = 0
    unsent = set()
    if not prog or prog[-1].op != OPTIMIZER_STEP or sum(i.op == OPTIMIZER_STEP for i in prog) != 1:
        raise AssertionError(f"rank {s}: the program must end with exactly one OPTIMIZER_STEP")
    for ins in prog:
        key = (ins.mb, ins.chunk)
        if ins.op in COMPUTE:
            live += _check_compute(s, ins, seen, unsent)
            peak = max(peak, live)
            if ins.op == BACKWARD_INPUT and virtual_stage(ins.chunk, p, s, where) > 0:
                unsent.add(key)
        elif ins.op in COMM:
            msg, dest = message_key(s, ins, p, where)
            table = sends if ins.op.startswith("SEND") else recvs
            assert msg not in table, f"rank {s}: {ins} duplicates a message {msg}"
            table[msg] = (s, dest, ins)
            if ins.op == SEND_ACT:
                assert key in seen[FORWARD], f"rank {s}: {ins} before its FORWARD"
            elif ins.op == SEND_GRAD:
                assert key in seen[BACKWARD], f"rank {s}: {ins} before its BACKWARD"
                unsent.discard(key)
            elif ins.op == RECV_ACT:
                assert key not in seen[FORWARD], f"rank {s}: {ins} after the FORWARD that needs it"
            else:
                assert key not in seen[BACKWARD], f"rank {s}: {ins} after the BACKWARD that needs it"
    want = {(mb, c) for mb in range(m) for c in range(v)}
    assert seen[FORWARD] == want and seen[BACKWARD] == want, (f"rank {s}: forwards {sorted(want - seen[FORWARD])} / "
                                                              f"backwards {sorted(want - seen[BACKWARD])} missing")
    no_w = seen[BACKWARD_INPUT] - seen[BACKWARD_WEIGHT]
    assert not no_w, f"rank {s}: the B's of {sorted(no_w)} have no W (BACKWARD_WEIGHT) before OPTIMIZER_STEP"
    return peak


def check_schedule(schedule, m):
    """Verify a schedule without communication; returns the peak stash per rank.

    * every (mb, chunk) has exactly one FORWARD on each rank and either one BACKWARD
      or one BACKWARD_INPUT (B) then one BACKWARD_WEIGHT (W), each after the FORWARD;
      OPTIMIZER_STEP last, after every backward and every W;
    * a B's SEND_GRAD comes before the rank's next compute (a B never waits on a W);
    * every send has exactly one matching receive (same kind, micro-batch and
      virtual stage, the right peer), every receive one send, and each RECV comes
      before the compute that consumes it, each SEND after the compute that
      produced it;
    * ``simulate`` finishes (no deadlock).
    Peak stash: most (mb, chunk) forwarded but not yet through their BACKWARD or W at
    once -- what is held between B and W counts (W reads the saved inputs)."""
    p, v, where = len(schedule), _chunks(schedule), schedule_placement(schedule)
    sends, recvs = {}, {}
    peaks = [_check_rank(s, prog, p, v, where, m, sends, recvs) for s, prog in enumerate(schedule)]
    for msg, (s, dest, ins) in sends.items():
        assert msg in recvs, f"rank {s}: {ins} has no matching receive ({msg})"
        r, _, rins = recvs[msg]
        assert (r, rins.chunk) == dest and rins.peer == s, f"{ins} on rank {s} does not match {rins} on rank {r}"
    for msg, (r, _, rins) in recvs.items():
        assert msg in sends, f"rank {r}: {rins} has no matching send ({msg})"
    simulate(schedule)
    return peaks


def bubble_fraction(spans, t_end=None):
    """Idle fraction of each rank: 1 - (time in computes: F, BACKWARD, B, W) / makespan, the
    makespan running from 0 to the last compute's end on any rank (or t_end).
    Spans of other kinds (a measured timeline's WAITs) count as idle."""
    spans = [[(i, s, e) for i, s, e in rank if i.op in COMPUTE] for rank in spans]
    end = t_end if t_end is not None else max(e for rank in spans for _, _, e in rank)
    return [1.0 - sum(e - s for _, s, e in rank) / end for rank in spans]


def theoretical_bubble(p, m, v=1, schedule=None):
    """The papers' idle share of the makespan, uniform stages, free communication.

    gpipe, 1f1b, interleaved (``schedule`` None or one of them): (p-1)/(v m + p-1), with
    t_b = 2 t_f (any fixed ratio gives the same; Narayanan et al., 2021). Interleaved
    (v > 1) reaches it when p divides m; for m < p it returns None (no closed form: the
    groups of p micro-batches never fill -- ``simulate`` gives the planned value).
    With t_F = t_B = t_W (zero_bubble.py, Qi et al., 2024): zb-h1 (p-1)/(3m + p-1) for
    m >= p; zb-v (p-1)/(6m + p-1) for m >= p; dualpipev (p-1)/(6m + p-1) for m >= 2p;
    None below those m."""
    if schedule in ("zb-h1", "zb-v", "dualpipev"):
        work, least = (3, p) if schedule == "zb-h1" else (6, p if schedule == "zb-v" else 2 * p)
        return (p - 1) / (work * m + p - 1) if m >= least else None
    if schedule not in (None, "gpipe", "1f1b", "interleaved"):
        raise ValueError(f"theoretical_bubble: unknown schedule {schedule!r}")
    if v > 1 and m % p:
        return None
    return (p - 1) / (v * m + p - 1)


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
        plan = [[(j, [i]) for j, i in enumerate(prog) if i.op in COMM] for prog in schedule]
    stuck = run_rendezvous(plan, schedule_placement(schedule))
    if stuck:
        raise DeadlockError("pipeline messages deadlock with blocking sends: " +
                            ", ".join(f"rank {s} at {plan[s][b][1]!r}" for s, b in stuck.items()))
