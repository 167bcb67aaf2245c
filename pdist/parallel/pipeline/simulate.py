"""Pipeline schedules run on paper: the timeline, the checker and the bubble.

``simulate`` runs every rank's program without communication (a compute waits
for the message it consumes; sends cost nothing), so a schedule is deadlock-free
under non-blocking sends iff it finishes. ``check_schedule`` checks a schedule's
structure (one FORWARD and one BACKWARD per micro-batch and chunk, matched
messages in the right places) and returns each rank's peak stash.
``bubble_fraction`` measures the idle share of a timeline (simulated or
measured); ``theoretical_bubble`` is the paper's (p-1)/(v m + p-1).
``simulate_rendezvous`` checks a message order under blocking sends.
"""
from pdist.parallel.pipeline.schedules import (BACKWARD, COMM, COMPUTE, FORWARD, OPTIMIZER_STEP, RECV_ACT,
                                               RECV_GRAD, SEND_ACT, SEND_GRAD, DeadlockError, message_key,
                                               rendezvous_batches, run_rendezvous, virtual_stage)


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
                    sent[message_key(s, ins, p)[0]] = clock[s]
                elif ins.op in (RECV_ACT, RECV_GRAD):
                    posted[s][message_key(s, ins, p)[0]] = True
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
                msg, dest = message_key(s, ins, p)
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
    stuck = run_rendezvous(plan)
    if stuck:
        raise DeadlockError("pipeline messages deadlock with blocking sends: " +
                            ", ".join(f"rank {s} at {plan[s][b][1]!r}" for s, b in stuck.items()))
