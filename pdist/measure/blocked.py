"""Host time blocked in communication: the record the waterfall and the straggler detector read.

Contract. While at least one consumer is on (``use(+1)``: the waterfall, pdist/measure/
waterfall.py; the straggler detector, pdist/faults/debug.py), every host interval spent
inside communication code is recorded once, outermost call only:

    kind "c"  a collective's call (``ProcessGroup._run``, the object collectives): from
              entering the call (before its fingerprint exchange) to returning; for an
              async op that is its issue; ``key`` =
              (group name, world ranks, sequence number): the same collective on every member
    kind "w"  ``Work.wait()`` of an async collective (the same ``key``)
    kind "p"  a point-to-point call that blocks (send, recv) or the wait of an isend/irecv

as ``(kind, key, group name, t_ready, t0, t1)`` (perf_counter seconds; ``t_ready`` = t0 for
kinds "c" and "w": when this rank entered the collective, or began waiting on it; MPI
progresses a non-blocking collective only inside MPI calls, so a rank that issued one and
went on computing holds it up until it waits; a member's arrival is its latest), newest ``KEEP``
kept; ``COUNT[0]`` numbers them (a consumer marks where its step starts), ``TOTAL[0]`` sums
their seconds (a consumer reads it around a phase: no list walk). What overlap hid (an async
op's transfer while the host computed) is in no interval: what is recorded is exposed.

Cost. Off: one list read per call. On: two clock reads and a tuple appended per call.
This module imports nothing of pdist (pdist.comm imports it; no cycle).
"""
import collections
import itertools
import time

KEEP = 16384
ON = [0]                 # consumers; > 0: record
TOTAL = [0.0]            # seconds blocked, outermost intervals, since the process started
COUNT = [0]              # intervals recorded so far
ROWS = collections.deque(maxlen=KEEP)
_depth = [0]
now = time.perf_counter


def use(delta):
    """A consumer turns on (+1) or off (-1); recording runs while any is on."""
    ON[0] = max(0, ON[0] + delta)


def reset():
    """Forget an interval left open by an exception (consumers call it at a step's start)."""
    _depth[0] = 0


def enter():
    """Open an interval: its start time (nested calls are folded into the outer one)."""
    _depth[0] += 1
    return now()


def leave(kind, group, t0, seq=None):
    """Close the interval opened at ``t0`` by ``group`` (a ProcessGroup); ``seq``: the
    collective's sequence number (kinds "c", "w"), whose key matches it across ranks."""
    _depth[0] -= 1
    if _depth[0] > 0:
        return
    _depth[0] = 0
    t1 = now()
    key = None if seq is None else (group.name, tuple(group.ranks), seq)
    ROWS.append((kind, key, group.name, t0 if key is not None else None, t0, t1))
    COUNT[0] += 1
    TOTAL[0] += t1 - t0


def since(mark):
    """The rows recorded after ``COUNT[0]`` was ``mark`` (all of them when KEEP allows)."""
    n = min(COUNT[0] - mark, len(ROWS))
    return list(itertools.islice(reversed(ROWS), n))[::-1] if n > 0 else []


__all__ = ["use", "reset", "enter", "leave", "since", "ON", "TOTAL", "COUNT", "ROWS"]
