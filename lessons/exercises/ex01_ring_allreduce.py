"""Exercise 01 (9 points): ring all-reduce over point-to-point messages.

Task. Write ``ring_all_reduce(group, buf)``: afterwards every rank's ``buf`` holds
sum_r buf_r (in place), using only ``group.isend`` / ``group.irecv`` (or
``group.sendrecv``, which posts both at once), never a collective.

Math (Patarasuk & Yuan 2009, sec. 3). Cut buf into n chunks,
``chunk_bounds(buf.size, n)`` (sizes may differ by one; some may be empty). Rank r
sends to r+1 and receives from r-1:

  reduce-scatter, steps s = 0..n-2: send chunk (r - s - 1) mod n, receive chunk
      (r - s - 2) mod n and add it into your own copy. After n-1 steps rank r holds
      the full sum of chunk r (the convention of docs/collectives.md and of
      ``reduce_scatter``: rank r's result is chunk r).
  all-gather, steps s = 0..n-2: send chunk (r - s) mod n (at s = 0 your finished
      chunk r), receive chunk (r - s - 1) mod n (overwrite, no add).

Each rank sends 2(n-1) chunks of S/n bytes: 2(n-1)/n * S, the lower bound for
all-reduce, whatever n is. The grader counts it (``group.stats["send"]``).

Hints.
* A blocking send to the right on every rank, then a receive from the left, waits
  forever once a chunk is too big for MPI to buffer (the grader uses 8 MiB): post the
  receive first (``irecv``), then ``isend``, then ``wait()`` both, or call
  ``group.sendrecv(sendbuf, dst, recvbuf, src)``.
* Receive into a scratch buffer, then add: ``buf[a:b] += tmp[:b - a]``.
* n = 1: nothing to do.
* pdist's own version is ``pdist/comm/algorithms.py`` (``allreduce_ring``); try
  without reading it first.

Grade: ``python -m pdist.grade 01`` (4 ranks under mpiexec, and sub-groups of 1, 2 and 3
of them, so your ring runs at n = 1..4; buffers whose size does not divide by n, some
smaller than n; a deadlock is reported by the watchdog's roll-call, which names where
each rank waits).
"""
from pdist.engine.backend import xp  # noqa: F401
from pdist.comm.algorithms import chunk_bounds  # noqa: F401


def ring_all_reduce(group, buf):
    """buf <- buf_0 + ... + buf_{n-1} on every rank of ``group`` (flat float array)."""
    raise NotImplementedError("exercise: ring all-reduce (reduce-scatter, then all-gather)")
