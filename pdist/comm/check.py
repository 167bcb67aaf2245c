"""Collective validation: every rank agrees on (op, seq, size, dtype, ...) or
every rank raises the same ``CollectiveMismatchError``. Never a hang, never
silent garbage.

Before each collective, each rank forms a fingerprint
``f = (op, seq, size, dtype, reduce-op, root, algorithm, async_op, local_error)`` and the
group runs one small all-reduce of ``[f, -f]`` with MAX, which yields
``max_r f_r`` and ``min_r f_r``. If they differ anywhere (or any rank found a
local error, e.g. ``out`` too small), all ranks see it in the same result, so
all of them gather the fingerprints and raise one error that names the op, its
sequence number and what each rank passed. A rank that skips a collective is
caught at its next one (op or seq differ).

Cost: one 144-byte all-reduce per collective (a few microseconds on one node;
see docs/collectives.md for the measured overhead). On by default; set
``PDIST_CHECK_COLLECTIVES=0`` (or ``pg.check = False``) to turn it off, after
which mismatched calls are undefined behaviour in MPI (garbage or a hang).
"""
import os

import numpy as np

from pdist.comm.mpi import MPI, wait_all

OPS = ["barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"]
REDOPS = ["", "sum", "avg", "max", "min"]
ALGOS = ["", "mpi", "naive", "ring", "tree", "pairwise"]
FIELDS = ["op", "seq", "size", "dtype", "reduce-op", "root", "algorithm", "async_op", "local error"]


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with different arguments (or one was invalid)."""


def default_on():
    return os.environ.get("PDIST_CHECK_COLLECTIVES", "1") != "0"


_OP, _RED, _ALG = ({k: i for i, k in enumerate(v)} for v in (OPS, REDOPS, ALGOS))


def fingerprint(op, seq, size=0, dtype=None, redop="", root=-1, algorithm="", error=None,
                async_op=False):
    """The 9 integers every rank must agree on (a Python list: cheap to build)."""
    return [_OP[op], seq, size, dtype.num if dtype is not None else -1,
            _RED[redop], root, _ALG[algorithm], int(bool(async_op)), 1 if error else 0]


def agree(comm, group_name, fp, error, describe, buf=None):
    """Raise CollectiveMismatchError on every rank unless all fingerprints match
    and no rank reported an error. ``describe`` is this rank's argument summary;
    ``buf`` an optional reusable int64 array of at least 18 elements."""
    finish = agree_start(comm, group_name, fp, error, describe, buf)
    finish()


def agree_start(comm, group_name, fp, error, describe, buf=None):
    """Post the fingerprint exchange (a non-blocking all-reduce) and return
    ``finish()``, which waits for it and raises on a mismatch. An ``async_op``
    collective posts its data right after this and calls ``finish()`` first
    thing in ``Work.wait()``: the check then costs no extra meeting of the ranks
    at issue time (DDP's buckets keep overlapping with backward). The exchange
    is always non-blocking, so it matches across ranks whatever their wait mode
    (MPI never matches a blocking collective with a non-blocking one)."""
    k = len(fp)
    if comm.Get_size() == 1:
        if error:
            raise CollectiveMismatchError(f"{OPS[fp[0]]} #{fp[1]} on group '{group_name}': {error}")
        return _nothing
    both = np.empty(2 * k, np.int64) if buf is None else buf[:2 * k]
    both[:k] = fp
    both[k:] = [-v for v in fp]
    req = comm.Iallreduce(MPI.IN_PLACE, both, MPI.MAX)

    def finish():
        wait_all([req])
        _verdict(comm, group_name, fp, error, describe, both.tolist())
    return finish


def _nothing():
    return None


def _verdict(comm, group_name, fp, error, describe, res):
    k = len(fp)
    hi, lo = res[:k], [-v for v in res[k:]]
    if hi == lo and hi[-1] == 0:
        return
    infos = comm.allgather((list(fp), describe() if callable(describe) else describe, error))
    bad = [FIELDS[i] for i in range(k - 1) if hi[i] != lo[i]]
    lines = []
    for r, (f, desc, err) in enumerate(infos):
        lines.append(f"  rank {r}: {OPS[f[0]]} #{f[1]} {desc}" + (f"  <- {err}" if err else ""))
    what = ("ranks disagree on " + ", ".join(bad)) if bad else "invalid arguments"
    raise CollectiveMismatchError(
        f"{OPS[fp[0]]} #{fp[1]} on group '{group_name}' ({comm.Get_size()} ranks): {what}\n"
        + "\n".join(lines))
