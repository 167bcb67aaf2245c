"""Blocking transports: the order a rank posts its pipeline messages in.

A lone NCCL send (or an MPI send past its eager limit) blocks until the peer posts the
receive. The executor therefore posts each rank's messages in batches, one group call
each, right before the compute that follows them (``comm_batches``), with a send that
would wait on a receive its peer posts only later moved to a later batch
(``rendezvous_batches``; deferring a send is always legal: its data is ready, only
its departure moves). ``run_rendezvous`` runs such a plan under the harshest
semantics (every operation blocks until its partner is posted);
``simulate.simulate_rendezvous`` checks the executor's plan with it.
"""
from pdist.parallel.pipeline.instructions import COMM, DeadlockError, message_key, schedule_placement


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


def run_rendezvous(batches, placement="loop"):
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
                    posted[(message_key(s, ins, p, placement)[0], ins.op.startswith("SEND"))] = s
        progressed = False
        for s in range(p):
            if pos[s] >= len(batches[s]):
                continue
            ok = True
            for ins in batches[s][pos[s]][1]:
                msg, is_send = message_key(s, ins, p, placement)[0], ins.op.startswith("SEND")
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
    (its data is ready; only its departure moves). Where deferring one batch at a time gets
    stuck (the V schedules, whose ranks receive out of their peers' send order),
    ``matched_batches`` places each send where its receive is posted. A pure function of
    the schedule: every rank computes the same plan."""
    plan = _deferred_batches(schedule)
    return plan if plan is not None else matched_batches(schedule)


def _deferred_batches(schedule):
    """``rendezvous_batches``' first try: sends deferred batch by batch; None if stuck."""
    plan = [[(a, list(b)) for a, b in comm_batches(prog)] for prog in schedule]
    p, where = len(schedule), schedule_placement(schedule)
    for _ in range(10 * sum(len(prog) for prog in schedule) + 10):
        stuck = run_rendezvous(plan, where)
        if stuck is None:
            return plan
        posted = {}
        for s, b in stuck.items():
            for ins in plan[s][b][1]:
                posted[(message_key(s, ins, p, where)[0], ins.op.startswith("SEND"))] = s
        moved = False
        for s, b in stuck.items():
            if b + 1 >= len(plan[s]):
                continue
            late = [i for i in plan[s][b][1] if i.op.startswith("SEND") and i.peer != s
                    and posted.get((message_key(s, i, p, where)[0], False)) != i.peer]
            if late:
                plan[s][b] = (plan[s][b][0], [i for i in plan[s][b][1] if i not in late])
                plan[s][b + 1] = (plan[s][b + 1][0], late + plan[s][b + 1][1])
                moved = True
        plan = [[(a, b) for a, b in rank if b] for rank in plan]
        if not moved:
            break
    return None


def _arrivals(prog):
    """The anchors of a program (each compute and the OPTIMIZER_STEP) with the run of
    messages right before each: [(anchor, recvs, sends)]."""
    out, run = [], []
    for j, ins in enumerate(prog):
        if ins.op in COMM:
            run.append(ins)
        else:
            out.append((j, [i for i in run if i.op.startswith("RECV")], [i for i in run if i.op.startswith("SEND")]))
            run = []
    return out


def matched_batches(schedule):
    """Blocking sends placed by matching: every rank walks its anchors; a receive is
    satisfied once its peer holds the matching send (created at or before the peer's current
    anchor), and that send joins the peer's batch at its current anchor; a rank passes an
    anchor once all its receives there are satisfied. Sends to itself are local copies, posted
    where they are made. Per pair of ranks the sends go out in the order the receives are
    posted. Raises DeadlockError when no rank can move (a true cycle of waits)."""
    p, where = len(schedule), schedule_placement(schedule)
    arr = [_arrivals(prog) for prog in schedule]
    pos, held, local = [0] * p, [dict() for _ in range(p)], [set() for _ in range(p)]
    batch = [[] for _ in range(p)]             # the batch being built at each rank's anchor
    plan, arrived = [[] for _ in range(p)], [False] * p
    while any(pos[s] < len(arr[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] >= len(arr[s]):
                continue
            anchor, recvs, sends = arr[s][pos[s]]
            if not arrived[s]:
                arrived[s] = moved = True
                for ins in sends:
                    key = message_key(s, ins, p, where)[0]
                    if ins.peer == s:
                        local[s].add(key)
                        batch[s].append(ins)
                    else:
                        held[s][key] = ins
            ok = True
            for ins in recvs:
                key = message_key(s, ins, p, where)[0]
                if ins in batch[s]:
                    continue
                if ins.peer == s and key in local[s]:
                    batch[s].append(ins)
                elif ins.peer != s and key in held[ins.peer]:
                    batch[ins.peer].append(held[ins.peer].pop(key))
                    batch[s].append(ins)
                else:
                    ok = False
                    break
            if ok and pos[s] == len(arr[s]) - 1 and held[s]:
                ok = False                     # the last anchor waits until every send is out
            if ok:
                if batch[s]:
                    plan[s].append((anchor, batch[s]))
                batch[s], pos[s], arrived[s], moved = [], pos[s] + 1, False, True
        if not moved:
            raise DeadlockError("pipeline messages deadlock with blocking sends: " + ", ".join(
                f"rank {s} at {schedule[s][arr[s][pos[s]][0]]!r} waiting for {arr[s][pos[s]][1]!r}"
                for s in range(p) if pos[s] < len(arr[s])))
    return plan
