"""Collective validation: every rank agrees on (op, seq, step, size, dtype, ...)
or every rank raises the same ``CollectiveMismatchError``. Never a hang, never
silent garbage.

Before each collective (object collectives and splits included), each rank
forms a fingerprint ``f = (op, seq, step, size, dtype, reduce-op, root,
algorithm, async_op, batch, local_error)`` and the group runs one small non-blocking
all-reduce of ``[f, -f]`` with MAX, which yields ``max_r f_r`` and
``min_r f_r``. If they differ anywhere (or any rank found a local error, e.g.
``out`` too small), all ranks see it in the same result, so all of them gather
the fingerprints and raise one error that names the op, its sequence number,
and every differing field's value per (world) rank. A rank that skips a
collective is caught at its next one (op or seq differ); a rank that skips or
repeats a training step (``comm.set_step``) at its first collective of the
next step; ranks handed different global batches (the hash a strategy stamps with
the step, pdist/parallel/batch_check.py) at the step's first collective
(``BatchMismatchError``). Dtypes compare by kind and item size (``int64 == longlong``).

Channels. The exchange runs on the group's own fingerprint communicator and
the verdict on another, so both stay in step on every rank whatever happened
to the data. After a mismatch the group replaces its data communicator (an
async op may have posted data the other ranks never will), so the group stays
usable.

Cost: one 176-byte all-reduce per collective (a few microseconds on one node;
see docs/collectives.md). Two ranks: one 88-byte message each way instead, and a small
blocking all-reduce carries it in its payload's message (pair.py: no second exchange). On by default; ``PDIST_CHECK_COLLECTIVES=0`` (or
``pg.check = False``) turns it off, after which mismatched calls are undefined
behaviour in MPI (garbage or a hang until the watchdog's deadline).
"""
import numpy as np

from pdist.comm.flight_recorder import _batch
from pdist.comm.mpi import MPI, wait_all

OPS = ["barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
       "all_gather_object", "broadcast_object", "gather_object", "split", "all_to_all_v"]
REDOPS = ["", "sum", "avg", "max", "min"]
ALGOS = ["", "mpi", "naive", "ring", "tree", "pairwise"]
FIELDS = ["op", "seq", "step", "size", "dtype", "reduce-op", "root", "algorithm", "async_op", "batch",
          "local error"]
K = len(FIELDS)


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with different arguments (or one was invalid)."""


class BatchMismatchError(CollectiveMismatchError):
    """Ranks that must train on the same global batch were handed different ones (the batch
    hash of the step stamp, ``flight_recorder.batch_hash``, differs)."""


def default_on():
    from pdist.engine.env import env_flag
    return env_flag("PDIST_CHECK_COLLECTIVES", True)


_OP, _RED, _ALG = ({k: i for i, k in enumerate(v)} for v in (OPS, REDOPS, ALGOS))


def dtype_code(dtype):
    """Equal for equal dtypes (int64 and longlong alike), different otherwise."""
    return -1 if dtype is None else (ord(dtype.kind) << 16) | dtype.itemsize


def fingerprint(op, seq, step, size=0, dtype=None, redop="", root=-1, algorithm="", error=None,
                async_op=False):
    """The integers every rank must agree on (a Python list: cheap to build). ``batch``:
    the step stamp's hash of the global batch (``set_step(k, batch=h)``; 0 outside a step)."""
    return [_OP[op], seq, step, size, dtype_code(dtype), _RED[redop], root, _ALG[algorithm],
            int(bool(async_op)), _batch[0], 1 if error else 0]


def agree(g, fp, error, describe, buf=None):
    """Raise CollectiveMismatchError on every rank of group ``g`` unless all
    fingerprints match and no rank reported an error. ``describe`` is this
    rank's argument summary: (dtype name, text). Two ranks: one point-to-point exchange
    (``g._pair``, pair.py)."""
    if g._pair is not None:
        return g._pair.agree(g, fp, error, describe)
    agree_start(g, fp, error, describe, buf)()


def agree_start(g, fp, error, describe, buf=None):
    """Post the fingerprint exchange (a non-blocking all-reduce) and return
    ``finish()``, which waits for it and raises on a mismatch. An ``async_op``
    collective posts its data right after this; the group calls ``finish()``
    in ``Work.wait()`` or before its next collective, whichever comes first. (A two-rank
    small all-reduce carries its payload in its check's message instead: pair_async.py.)"""
    if g.size == 1:
        if error:
            raise CollectiveMismatchError(f"{OPS[fp[0]]} #{fp[1]} on group '{g.name}': {error}")
        return _nothing
    if g._pair is not None:
        return g._pair.start(g, fp, error, describe)
    both = np.empty(2 * K, np.int64) if buf is None or len(buf) < 2 * K else buf[:2 * K]
    both[:K] = fp
    both[K:] = [-v for v in fp]
    req = g._fp.Iallreduce(MPI.IN_PLACE, both, MPI.MAX)

    def finish():
        wait_all([req])
        _verdict(g, fp, error, describe, both.tolist())
    finish.ready = req.Test          # has every rank posted it? (never blocks)
    return finish


def _nothing():
    return None


def _by_value(values):
    """{value: [ranks]} in first-seen order."""
    out = {}
    for r, v in values:
        out.setdefault(v, []).append(r)
    return out


def _names(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _field_line(name, values):
    groups = _by_value(values)
    if name == "step":                        # "rank 1 is at step 4; ranks 0, 2, 3 at step 5"
        ordered = sorted(groups.items(), key=lambda kv: len(kv[1]))
        return "; ".join(f"{_names(rs)}{(' is' if len(rs) == 1 else ' are') if i == 0 else ''} at step {v}"
                         for i, (v, rs) in enumerate(ordered))
    return f"{name}: " + "; ".join(f"{_names(rs)} = {v}" for v, rs in groups.items())


def _batch_headline(world, infos):
    """'every rank must pass the same global batch ...; rank 1's differs from rank 0's: ...'."""
    first = infos[0][0][9]
    other = [world[r] for r, (f, _, _, _) in enumerate(infos) if f[9] != first]
    who = f"rank {other[0]}'s" if len(other) == 1 else f"ranks {', '.join(map(str, other))}' batches"
    return (f"step {infos[0][0][2]}: every rank must pass the same global batch (x, y) to local_batch() "
            f"(get_batch(step) must return it on every rank); {who} {'differs' if len(other) == 1 else 'differ'} "
            f"from rank {world[0]}'s: seed the loader with the step, not the rank "
            f"(pdist.data.get_batch(tokens, B, T, seed, step)). PDIST_CHECK_BATCH=0 (or model.check_batch = "
            f"False) turns this check off.")


def _verdict(g, fp, error, describe, res):
    hi, lo = res[:K], [-v for v in res[K:]]
    if hi == lo and hi[-1] == 0:
        return
    wait_all([g._vcomm.Ibarrier()])            # every member is here: the gather cannot hang
    dt, desc = describe() if callable(describe) else describe
    infos = g._vcomm.allgather((list(fp), dt, desc, error))
    g._reset_data()                            # data posted by an async op is orphaned
    world = g.ranks
    decode = {"op": lambda f, d: OPS[f[0]], "seq": lambda f, d: f[1], "step": lambda f, d: f[2],
              "size": lambda f, d: f[3], "dtype": lambda f, d: d, "reduce-op": lambda f, d: REDOPS[f[5]] or "-",
              "root": lambda f, d: f[6], "algorithm": lambda f, d: ALGOS[f[7]] or "-",
              "async_op": lambda f, d: bool(f[8]), "batch": lambda f, d: f"{f[9]:016x}"}
    bad = [FIELDS[i] for i in range(K - 1) if hi[i] != lo[i]]
    fields = [_field_line(name, [(world[r], decode[name](f, d)) for r, (f, d, _, _) in enumerate(infos)])
              for name in bad]
    lines = _rank_lines(g, infos, bad)
    what = _headline(bad, [(world[r], err) for r, (*_, err) in enumerate(infos)])
    if "batch" in bad and "step" not in bad:
        raise BatchMismatchError(_batch_headline(world, infos) + "\n" + f"{OPS[fp[0]]} #{fp[1]} on group "
                                 f"'{g.name}': {what}\n" + "".join(f"  {x}\n" for x in fields) + "\n".join(lines))
    raise CollectiveMismatchError(
        f"{OPS[fp[0]]} #{fp[1]} on group '{g.name}' ({g.size} ranks, world ranks {world}): {what}\n"
        + "".join(f"  {x}\n" for x in fields) + "\n".join(lines))


def _headline(bad, errors):
    """What went wrong, first: the fields the ranks disagree on, else each rank's own error
    ('rank 3: async all_reduce #34 ... was never waited on'), grouped by error."""
    if bad:
        return "ranks disagree on " + ", ".join(bad)
    said = _by_value([(r, e) for r, e in errors if e])
    return "; ".join(f"{_names(rs)}: {e}" for e, rs in said.items()) or "invalid arguments"


def _rank_lines(g, infos, bad):
    """One line per distinct (call, error), naming the ranks that made it: identical
    fingerprints are one line 'ranks 0, 1, 2: all_reduce #36 step 5 size=...'; a rank's own
    error follows its call unless the headline already gave it (no field differs)."""
    calls = _by_value([(r, (f"{OPS[f[0]]} #{f[1]} step {f[2]} {desc}", err))
                       for r, (f, _, desc, err) in enumerate(infos)])
    lines = []
    for (call, err), rs in calls.items():
        who = _names([g.ranks[r] for r in rs]) + ("" if g.name == "world" else f" ({g.name} {_names(rs)})")
        lines.append(f"  {who}: {call}" + ((f"  <- {err}" if bad else "  <- the error above") if err else ""))
    return lines
