"""Collectives on 2-byte floats (bfloat16, float16) over MPI.

MPI has no bfloat16 datatype (and MPICH's float16 sum is not everywhere), so the
bytes travel as raw 16-bit words (``backend.words``, a ``uint16`` view: no conversion,
2 bytes per element on the wire, the mixed-precision theory), and a reduction is done
on upcast values by the rank that owns the result, once:

    reduce_scatter(out, inp):  all-to-all of the n chunks of inp (chunk q to rank q),
                               then out = round(Σ_{q=0}^{n-1} fp32(chunk from q)) (÷ n for avg)
    all_reduce(buf):           the same on buf padded to a multiple of n, then an
                               all-gather of the rounded chunks
    reduce(buf, dst):          a gather of every rank's buf at dst, which sums them the
                               same way into its buf (the others' buf unchanged)

Rank q's term is added in the order q = 0, 1, ..., n-1, in float32, and the result
is rounded to the low dtype once: every rank gets the same bits, and they equal one
process summing n micro-batch gradients in fp32 (pdist.engine.grad_rounding.GradAccumulator).
Bytes per rank: (n-1)/n S for the reduce-scatter (the all-to-all moves exactly the
chunks a ring reduce-scatter moves) and 2(n-1)/n S for the all-reduce (S = the
low-precision tensor's bytes), the ring accounting of docs/design.md.

Device arrays over NCCL (``nccl_*``) take the same two phases: the chunks travel as raw
bytes (grouped ncclSend/ncclRecv of ``uint8``, then ncclAllGather), and ``_sum_rows`` runs
on the group's communication stream, so the bits equal the CPU path's on every rank.
"""
import numpy as np
from mpi4py import MPI

from pdist.engine.backend import array_module, words


def _sum_rows(rows, out, op):
    """out <- round(rows[0] (op) rows[1] (op) ...), in float32, rank order (NumPy or CuPy)."""
    xp = array_module(rows)
    acc = rows[0].astype(np.float32)                                      # (chunk,)
    for q in range(1, rows.shape[0]):
        if op in ("sum", "avg"):
            acc += rows[q].astype(np.float32)
        else:
            (xp.maximum if op == "max" else xp.minimum)(acc, rows[q].astype(np.float32), out=acc)
    if op == "avg":
        acc /= rows.shape[0]
    out[...] = acc.astype(out.dtype)


def reduce_scatter(comm, out, inp, counts, op, wait_all):
    """Returns wait(): the all-to-all is in flight; wait() finishes it and reduces
    (``wait.ready()`` polls the all-to-all without blocking)."""
    n, r = comm.Get_size(), comm.Get_rank()
    if len(set(counts)) == 1:
        recv = np.empty(n * counts[r], dtype=inp.dtype)                     # (n, chunk) flat
        req = comm.Ialltoall(words(inp), words(recv))
    else:
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        recv = np.empty(n * counts[r], dtype=inp.dtype)
        rd = [q * counts[r] for q in range(n)]
        req = comm.Ialltoallv([words(inp), (list(counts), displs), MPI.UINT16_T],
                              [words(recv), ([counts[r]] * n, rd), MPI.UINT16_T])

    def wait():
        wait_all([req])
        _sum_rows(recv.reshape(n, counts[r]), out, op)
    wait.ready = req.Test
    return wait


def all_reduce(comm, buf, op, wait_all):
    """Returns wait(): the reduce-scatter's all-to-all is in flight; wait() reduces
    this rank's chunk and all-gathers the rounded chunks into ``buf``."""
    n = comm.Get_size()
    m = -(-buf.size // n) * n
    send = np.zeros(m, dtype=buf.dtype)                                     # (m,) padded copy
    send[:buf.size] = buf
    chunk = np.empty(m // n, dtype=buf.dtype)
    finish_rs = reduce_scatter(comm, chunk, send, [m // n] * n, op, wait_all)

    def wait():
        finish_rs()
        wait_all([comm.Iallgather(words(chunk), words(send))])
        buf[...] = send[:buf.size]
    wait.ready = finish_rs.ready
    return wait


def reduce(comm, buf, dst, op, wait_all):
    """Returns wait(): every rank's ``buf`` is being gathered at ``dst``; wait() sums the rows
    there (float32, rank order, rounded once) into dst's ``buf``. ``buf`` is contiguous, 1-D."""
    n, root = comm.Get_size(), comm.Get_rank() == dst
    recv = np.empty(n * buf.size, dtype=buf.dtype) if root else None          # (n, size) flat
    req = comm.Igather(words(buf), words(recv) if root else None, root=dst)

    def wait():
        wait_all([req])
        if root:
            _sum_rows(recv.reshape(n, buf.size), buf, op)
    wait.ready = req.Test
    return wait


# ----------------------------------------------------------- device arrays over NCCL
def _raw(a):
    return a.view(array_module(a).uint8)                                    # (2 * size,) bytes


def _exchange(be, rows, inp, counts, s):
    """Inside one NCCL group call on stream ``s``: chunk q of ``inp`` to rank q, and row q of
    ``rows`` (n, counts[rank]) from rank q (this rank's own row is copied before)."""
    nccl, r, u8 = be._nccl, be.rank, be._nccl.NCCL_UINT8
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    nccl.groupStart()
    for q in range(be.size):
        if q == r:
            continue
        if counts[q]:
            chunk = _raw(inp[starts[q]:starts[q + 1]])
            be.nc.send(chunk.data.ptr, chunk.size, u8, q, s)
        if counts[r]:
            row = _raw(rows[q])
            be.nc.recv(row.data.ptr, row.size, u8, q, s)
    nccl.groupEnd()


def nccl_reduce_scatter(be, out, inp, counts, op):
    """(event, buffers to keep): out <- round(Σ_q fp32(chunk r of rank q's inp)), rank order."""
    xp, r = array_module(inp), be.rank
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    rows = xp.empty((be.size, counts[r]), dtype=inp.dtype)                  # (n, chunk)
    rows[r] = inp[starts[r]:starts[r + 1]]
    be._issue(lambda s: _exchange(be, rows, inp, counts, s))
    done = be._on_stream(lambda: _sum_rows(rows, out, op))                  # after the exchange
    return done, (rows, out, inp)


def nccl_all_reduce(be, buf, op):
    """(event, keep): the reduce-scatter above on buf padded to a multiple of n, then an
    ncclAllGather of the rounded chunks (raw bytes) into buf."""
    xp, n = array_module(buf), be.size
    m = -(-buf.size // n) * n
    send = xp.zeros(m, dtype=buf.dtype)                                     # (m,) padded copy
    send[:buf.size] = buf
    chunk = xp.empty(m // n, dtype=buf.dtype)
    _, keep = nccl_reduce_scatter(be, chunk, send, [m // n] * n, op)
    c, full = _raw(chunk), _raw(send)
    be._issue(lambda s: be.nc.allGather(c.data.ptr, full.data.ptr, c.size, be._nccl.NCCL_UINT8, s))

    def back():
        buf[...] = send[:buf.size]
    return be._on_stream(back), keep + (send, buf)


def nccl_reduce(be, buf, dst, op):
    """(event, keep): every rank's buf gathered at ``dst`` (grouped send/recv of raw bytes),
    which sums the rows there in float32, rank order, rounded once; the others' buf unchanged."""
    xp, n, root = array_module(buf), be.size, be.rank == dst
    rows = xp.empty((n, buf.size), dtype=buf.dtype) if root else None       # (n, size)
    if root:
        rows[dst] = buf

    def go(s):
        u8 = be._nccl.NCCL_UINT8
        be._nccl.groupStart()
        if root:
            for q in range(n):
                if q != dst:
                    row = _raw(rows[q])
                    be.nc.recv(row.data.ptr, row.size, u8, q, s)
        else:
            b = _raw(buf)
            be.nc.send(b.data.ptr, b.size, u8, dst, s)
        be._nccl.groupEnd()
    done = be._issue(go)
    if root:
        done = be._on_stream(lambda: _sum_rows(rows, buf, op))
    return done, (rows, buf)


__all__ = ["words", "reduce_scatter", "all_reduce", "reduce", "nccl_reduce_scatter", "nccl_all_reduce",
           "nccl_reduce"]
