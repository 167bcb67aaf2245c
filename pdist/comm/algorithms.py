"""Collectives built by hand over point-to-point, naive beside optimized.

Every function takes ``t``, a point-to-point transport with ``t.rank``,
``t.size``, ``t.send(buf, dst)``, ``t.recv(buf, src)`` and
``t.sendrecv(sendbuf, dst, recvbuf, src)`` and its segmented twin
``t.sendrecv_iter`` (MPI or NCCL; the algorithm does not know which), and flat contiguous arrays, NumPy or CuPy: each function takes the array module
from its buffers (``array_module``), never from the global backend, so a NumPy
collective stays on the host when ``PDIST_DEVICE=gpu``.

Costs use the alpha-beta model: a message of m bytes costs ``alpha + m*beta``.
n ranks, S bytes in the full tensor. The lower bound for all-reduce is that
every rank must send and receive ``2(n-1)/n * S`` (Patarasuk & Yuan, 2009);
the ring meets it, which is why its *bus bandwidth* (nccl-tests: algbw *
2(n-1)/n) approaches the link bandwidth.

Chunks: the tensor is split as ``chunk_bounds(size, n)`` (numpy.array_split's
boundaries: the first ``size % n`` chunks hold one extra element), so sizes
not divisible by n, and sizes smaller than n (empty chunks), work.
"""
from pdist.engine.backend import array_module


def chunk_bounds(size, n):
    """[(start, stop)] of n nearly equal chunks of ``size`` elements, the first
    ``size % n`` one longer; equal to numpy.array_split's boundaries."""
    q, r = divmod(int(size), int(n))
    bounds, start = [], 0
    for i in range(n):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reduce_into(op, acc, other, out=None):
    """out <- acc (op) other, in place into acc unless ``out`` is given
    (op: "sum"/"avg" add, "max", "min")."""
    m = array_module(acc)
    fn = m.maximum if op == "max" else m.minimum if op == "min" else m.add
    fn(acc, other, out=acc if out is None else out)


# --------------------------------------------------------------------- naive

def reduce_naive(t, buf, dst, op, scratch=None):
    """result = buf_0 (op) buf_1 (op) ... (op) buf_{n-1}, in rank order, at ``dst``.

    For learning: every rank sends all S bytes straight to ``dst``, which
    receives and reduces n-1 messages one after another.
    Time ~ (n-1)(alpha + S*beta) at dst; others send S. ``buf`` on other ranks
    is unchanged."""
    n = t.size
    if t.rank != dst:
        t.send(buf, dst)
        return
    xp = array_module(buf)
    tmp = xp.empty_like(buf) if scratch is None else scratch
    acc = xp.empty_like(buf)
    for r in range(n):                      # fixed rank order: every run reduces alike
        if r == dst:
            src = buf
        else:
            t.recv(tmp, r)
            src = tmp
        if r == 0:
            acc[...] = src
        else:
            reduce_into(op, acc, src)
    buf[...] = acc


def broadcast_naive(t, buf, src):
    """buf_r <- buf_src for every r. For learning: the root sends S to each
    of the n-1 others in turn. Time ~ (n-1)(alpha + S*beta); root sends (n-1)S."""
    if t.rank == src:
        for r in range(t.size):
            if r != src:
                t.send(buf, r)
    else:
        t.recv(buf, src)


def allreduce_naive(t, buf, op):
    """buf <- sum_r buf_r on every rank. For learning: reduce to rank 0 (rank
    order), then rank 0 sends the result to everyone. Rank 0 receives and sends
    (n-1)S: time ~ 2(n-1)(alpha + S*beta), against the ring's 2(n-1)/n S."""
    reduce_naive(t, buf, 0, op)
    broadcast_naive(t, buf, 0)


def reduce_scatter_naive(t, out, inp, op):
    """out_r <- chunk r of sum_q inp_q. For learning: reduce the whole tensor
    at rank 0, which then sends each rank its chunk. ``inp`` is unchanged."""
    bounds = chunk_bounds(inp.size, t.size)
    full = inp.copy()
    reduce_naive(t, full, 0, op)
    if t.rank == 0:
        for r, (a, b) in enumerate(bounds):
            if r:
                t.send(full[a:b], r)
        out[...] = full[bounds[0][0]:bounds[0][1]]
    else:
        t.recv(out, 0)


def all_gather_naive(t, out, inp):
    """out[chunk r] <- inp_r on every rank. For learning: everyone sends its
    chunk to rank 0, which then sends the whole tensor to everyone."""
    bounds = chunk_bounds(out.size, t.size)
    a, b = bounds[t.rank]
    out[a:b] = inp
    if t.rank == 0:
        for r, (a, b) in enumerate(bounds[1:], start=1):
            t.recv(out[a:b], r)
    else:
        t.send(inp, 0)
    broadcast_naive(t, out, 0)


# ---------------------------------------------------------------------- ring

def reduce_scatter_ring(t, out, inp, op):
    """out_r <- chunk r of (inp_0 (op) ... (op) inp_{n-1}), around a ring.

    Step s = 0..n-2: rank r sends its running partial of chunk (r-s-1) mod n to
    rank r+1, receives the partial of chunk (r-s-2) mod n from rank r-1 and adds
    its own piece of that chunk. After n-1 steps chunk r holds all n terms.
    Sends (n-1) chunks of S/n: (n-1)/n*S per rank, time ~ (n-1)(alpha + S/n*beta).
    Two chunk-sized buffers only; ``inp`` is read, never written (unless ``out``
    is ``inp``'s own chunk r, as in-place all-reduce uses it); the last step
    reduces straight into ``out``. Each step's
    message travels in segments (``t.sendrecv_iter``), so adding segment k
    overlaps receiving segment k+1: the step costs ~max(copy, add), not the sum."""
    n, r = t.size, t.rank
    bounds = chunk_bounds(inp.size, n)
    if n == 1:
        out[...] = inp
        return
    m = max(b - a for a, b in bounds)
    xp = array_module(inp)
    send_buf, recv_buf = xp.empty(m, inp.dtype), xp.empty(m, inp.dtype)
    a, b = bounds[(r - 1) % n]
    send = inp[a:b]                                         # step 0 sends our raw piece
    for s in range(n - 1):
        a, b = bounds[(r - s - 2) % n]
        got = recv_buf[:b - a]
        mine = inp[a:b]
        # the last step's chunk is r itself: reduce straight into ``out`` (no final copy;
        # out may be mine itself, as in-place all-reduce passes it)
        dest = out if s == n - 2 else got
        for c, d in t.sendrecv_iter(send, (r + 1) % n, got, (r - 1) % n):
            reduce_into(op, got[c:d], mine[c:d], out=dest[c:d])   # segment k while k+1.. arrive
        send, send_buf, recv_buf = got, recv_buf, send_buf


def all_gather_ring(t, out, inp):
    """out[chunk q] <- inp_q on every rank, around a ring.

    Step s = 0..n-2: rank r sends chunk (r-s) mod n to rank r+1 and receives
    chunk (r-s-1) mod n from rank r-1 straight into ``out``. Sends (n-1)/n*S per
    rank, time ~ (n-1)(alpha + S/n*beta); no extra buffer."""
    n, r = t.size, t.rank
    bounds = chunk_bounds(out.size, n)
    a, b = bounds[r]
    out[a:b] = inp                       # a no-op copy when inp is already out's chunk
    for s in range(n - 1):
        sa, sb = bounds[(r - s) % n]
        ra, rb = bounds[(r - s - 1) % n]
        t.sendrecv(out[sa:sb], (r + 1) % n, out[ra:rb], (r - 1) % n)


def allreduce_ring(t, buf, op):
    """buf <- buf_0 (op) ... (op) buf_{n-1} on every rank: ring reduce-scatter
    then ring all-gather, in place (Patarasuk & Yuan 2009; Baidu/Horovod ring).

    Each rank sends 2(n-1)/n*S (the lower bound), time ~
    2(n-1)(alpha + S/n*beta): bandwidth-optimal, latency linear in n. Every
    chunk is reduced once, by one rank, then copied: all ranks end bit-identical."""
    a, b = chunk_bounds(buf.size, t.size)[t.rank]
    reduce_scatter_ring(t, buf[a:b], buf, op)
    all_gather_ring(t, buf, buf[a:b])


# ---------------------------------------------------------------------- tree

def broadcast_tree(t, buf, src):
    """buf_r <- buf_src via a binomial tree. With v = (r - src) mod n, rank v
    receives from v - 2^k (its lowest set bit 2^k), then sends to v + 2^j for
    2^j < 2^k. ceil(log2 n) rounds: time ~ ceil(log2 n)(alpha + S*beta), best
    for small messages (latency-bound); any n, not only powers of two."""
    n = t.size
    v = (t.rank - src) % n
    mask = 1
    while mask < n:
        if v & mask:
            t.recv(buf, (v - mask + src) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            t.send(buf, (v + mask + src) % n)
        mask >>= 1


def reduce_tree(t, buf, dst, op):
    """result at ``dst`` via a binomial tree, the mirror of ``broadcast_tree``:
    v = (r - dst) mod n receives partials from v + 2^j (2^j below its lowest set
    bit), adds them, and sends its partial to v - 2^k. ceil(log2 n) rounds;
    ``buf`` on ranks other than dst is unchanged."""
    n = t.size
    v = (t.rank - dst) % n
    acc = buf if v == 0 else buf.copy()
    tmp = array_module(buf).empty_like(buf)
    mask = 1
    while mask < n:
        if v & mask:
            t.send(acc, (v - mask + dst) % n)
            return
        if v + mask < n:
            t.recv(tmp, (v + mask + dst) % n)
            reduce_into(op, acc, tmp)
        mask <<= 1


# ----------------------------------------------------------------- all-to-all

def all_to_all_pairwise(t, out, inp):
    """out[chunk q] <- chunk r of inp_q (a transpose across ranks). Step
    s = 1..n-1: send chunk r+s to rank r+s while receiving from rank r-s.
    Sends (n-1)/n*S per rank in n-1 rounds."""
    n, r = t.size, t.rank
    k = inp.size // n
    out[r * k:(r + 1) * k] = inp[r * k:(r + 1) * k]
    for s in range(1, n):
        d, q = (r + s) % n, (r - s) % n
        t.sendrecv(inp[d * k:(d + 1) * k], d, out[q * k:(q + 1) * k], q)


def row_size(a):
    """Elements per axis-0 row of ``a`` (1 for a vector)."""
    k = 1
    for d in a.shape[1:]:
        k *= int(d)
    return k


def counts_error(send_counts, recv_counts, inp, out, n):
    """(send, recv, error) for all_to_all_v: the counts as int lists, and a message naming
    what to change when they don't fit ``inp``/``out`` (None when they do)."""
    try:
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    except (TypeError, ValueError):
        return [0] * n, [0] * n, f"send_counts/recv_counts must be sequences of {n} integers"
    if len(sc) != n or len(rc) != n:
        return sc, rc, (f"send_counts has {len(sc)} and recv_counts {len(rc)} entries; "
                        f"both need one per rank of the group ({n})")
    if min(sc + rc) < 0:
        return sc, rc, f"counts must be >= 0, got send_counts={sc} recv_counts={rc}"
    rows_in, rows_out = (a.shape[0] if a.ndim else 1 for a in (inp, out))
    if sum(sc) != rows_in or sum(rc) != rows_out:
        return sc, rc, (f"sum(send_counts)={sum(sc)} must equal inp.shape[0]={rows_in} and "
                        f"sum(recv_counts)={sum(rc)} out.shape[0]={rows_out}")
    if inp.shape[1:] != out.shape[1:] or inp.dtype != out.dtype:
        return sc, rc, (f"out rows {out.shape[1:]} x {out.dtype} must match inp rows "
                        f"{inp.shape[1:]} x {inp.dtype}")
    return sc, rc, None


def displacements(counts):
    """[0, c0, c0+c1, ...]: where each rank's block starts."""
    d = [0]
    for c in counts[:-1]:
        d.append(d[-1] + c)
    return d


def all_to_all_v_pairwise(t, out, inp, send_counts, recv_counts):
    """all_to_all_v by hand (counts in elements): step s = 1..n-1, send the block of rank
    r+s while receiving rank r-s's block; empty blocks travel as empty messages, so both
    sides always post. Sends sum_{q != r} send_counts[q] elements in n-1 rounds."""
    n, r = t.size, t.rank
    sd, rd = displacements(send_counts), displacements(recv_counts)
    out[rd[r]:rd[r] + recv_counts[r]] = inp[sd[r]:sd[r] + send_counts[r]]
    for s in range(1, n):
        d, q = (r + s) % n, (r - s) % n
        t.sendrecv(inp[sd[d]:sd[d] + send_counts[d]], d, out[rd[q]:rd[q] + recv_counts[q]], q)
