"""Arrival skew: who reaches the step's collectives last, and by how much; and the slow-link
signature (the straggler detector's, pdist/faults/debug.py).

Phase durations can hide a slow rank: when DDP's bucketed all-reduce overlaps backward, a
rank that waits for its peers inside the step looks as long as the one it waits for. The
arrivals cannot: every collective of a step has one arrival per member, when it entered the
call or, async, began to wait on it (MPI progresses a non-blocking collective only inside
MPI calls; pdist/measure/blocked.py; clocks aligned at a barrier's exit by ``debug.gather``).
The last to arrive holds the others up by its lead over the second last. For rank i, step j:

    late[i][j] = max over the step's collectives c that i reaches last of ( a_i(c) - max_{q != i} a_q(c) )

(issues and wait starts compared apart). A throttled device holds the group up on (almost)
every step by about its extra compute; once it arrives the others follow within noise, so
their ``late`` stays near zero.
"""
import collections
import socket


def _median(v):
    v = sorted(v)
    n = len(v)
    return 0.0 if n == 0 else (v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]))


def lateness(by, steps):
    """``late[i][j]`` of the module doc; ``by[i]``: rank i's records by step, each with its
    "entries" [(collective key, aligned time, 1 if a wait's start else 0)]. Entries and wait
    starts are compared apart (an async op's issue with issues, its wait with waits), and a
    rank's first wait on an op counts."""
    n, k = len(by), len(steps)
    late = [[0.0] * k for _ in range(n)]
    for j, s in enumerate(steps):
        seen = collections.defaultdict(dict)            # (key, is wait) -> {rank index: time}
        for i in range(n):
            for key, t, wait in by[i][s].get("entries") or ():
                seen[(tuple(key) if isinstance(key, list) else key, wait)].setdefault(i, t)
        for members in seen.values():
            if len(members) < 2:
                continue
            last = max(members, key=members.get)
            lead = members[last] - max(u for q, u in members.items() if q != last)
            late[last][j] = max(late[last][j], lead)
    return late


def skew_straggler(t, threshold, report):
    """The report of a rank that holds the step's collectives up by more than ``threshold``
    x the others' median compute on at least two thirds of the steps, though its own compute
    does not stand out every step (overlap blurred it), or None. Two thirds, not the compute
    signature's 80%: the others' lateness stays near zero, far below a straggler's, so one
    step lost to noise on shared cores must not hide it. ``t``: debug's _Steps; ``report``:
    the Report class."""
    if t.n < 2 or t.k == 0:
        return None
    mean_late = [sum(v) / t.k for v in t.late]
    slow = max(range(t.n), key=lambda i: mean_late[i])
    others = [q for q in range(t.n) if q != slow]
    base = [_median([t.comp[q][j] for q in others]) for j in range(t.k)]
    excess = [t.late[slow][j] / max(base[j], 1e-9) for j in range(t.k)]
    late_steps = [j for j in range(t.k) if excess[j] > threshold]
    if 3 * len(late_steps) < 2 * t.k:
        return None
    factor = 1 + sum(excess[j] for j in late_steps) / len(late_steps)
    extra = sum(t.late[slow][j] for j in late_steps) / len(late_steps)
    text = (f"straggler: rank {t.ranks[slow]} (throttled device, from the collectives' arrivals): it holds "
            f"the others up {extra * 1e3:.1f} ms per step, arriving last, on {len(late_steps)}/{t.k} "
            f"steps, {factor:.2f}x the others' compute; its phase times do not show it (communication "
            f"overlapping the step hides who waits for whom).")
    return report(rank=t.ranks[slow], cause="throttled device", slowdown=factor, extra_s=extra, phase="grad_sync",
                  link=None, rows=t.rows, steps_slow=len(late_steps), steps=t.k, text=text)


def slow_link(t, report):
    """The slow-link signature: the report of a step spent on the wire (over 30% of it in
    communication), naming the group of the most link seconds (averaged over the ranks), or None."""
    if t.comm_t <= 0.3 * t.step_t:
        return None
    links = {}
    for p in t.per:
        for name, (rk, s) in p.get("links", {}).items():
            key = (name, tuple(rk))
            links[key] = links.get(key, 0.0) + s / len(t.per)
    worst = max(links.items(), key=lambda kv: kv[1]) if links else None
    link = (worst[0][0], list(worst[0][1]), worst[1]) if worst else None
    where = (f"group '{link[0]}' (world ranks {link[1]}) accumulated {link[2]:.3f} s of link time"
             if link else "the collectives' transfers (no simulated link recorded)")
    text = (f"slow link: no rank is slow in compute every step; every rank spends {t.comm_t * 1e3:.1f} of "
            f"{t.step_t * 1e3:.1f} ms/step communicating, not waiting for a peer; {where}.")
    return report(rank=None, cause="slow link", slowdown=1 + t.mean_ex[t.slow], extra_s=0.0, phase="grad_sync",
                  link=link, rows=t.rows, text=text)


def where():
    """This rank's hostname and its groups that cross nodes ({group name: world ranks}; nodes
    by hostname, pdist/comm/nodes.py): what ``debug.gather`` adds to its records."""
    from pdist.comm import nodes, watchdog
    return {"host": socket.gethostname(),
            "crossing": {g.name: list(g.ranks) for g in watchdog.groups() if len(nodes.spans(g.ranks)) > 1}}


def on_nodes(rep, per):
    """On several nodes (the ranks' hostnames in ``per``, debug's gathered records): each row's
    node, ``rep.nodes`` ({hostname: world ranks}), and the report's text says where the slow rank
    is, or, for a slow link with no simulated one, which groups cross the real link."""
    hosts = [p.get("host") for p in per]
    if None in hosts or len(set(hosts)) < 2:
        return rep
    rep.nodes = {}
    for p in per:
        rep.nodes.setdefault(p["host"], []).append(p["rank"])
    for row in rep.rows:
        row["node"] = hosts[[p["rank"] for p in per].index(row["rank"])]
    text = f" {len(rep.nodes)} nodes: " + "; ".join(f"{h} ranks {r}" for h, r in rep.nodes.items())
    if rep.rank is not None:
        text += f"; rank {rep.rank} is on {hosts[[p['rank'] for p in per].index(rep.rank)]}"
    crossing = sorted({(name, tuple(rk)) for p in per for name, rk in (p.get("crossing") or {}).items()})
    if rep.cause == "slow link" and rep.link is None and crossing:
        text += "; the groups crossing nodes (the real link): " + ", ".join(f"{n} {list(r)}" for n, r in crossing)
    rep.text += text + "."
    return rep


__all__ = ["lateness", "skew_straggler", "slow_link", "where", "on_nodes"]
