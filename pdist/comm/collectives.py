"""The collectives of ProcessGroup: argument checks, bytes accounted, algorithms.

Each call checks its arguments (an error is raised on every rank together,
after the fingerprint exchange: check.py), names the bytes a ring moves, and
hands the group's ``_run`` (group.py) the transport's own call and the
hand-built algorithms it offers.

Algorithms: ``"mpi"`` (the default: the transport's own collective), and the
hand-built ones of algorithms.py over point-to-point: all_reduce ``naive``,
``ring``; reduce_scatter / all_gather ``naive``, ``ring``; broadcast ``naive``,
``tree``; reduce ``naive``, ``tree``; all_to_all(_v) ``pairwise``. Hand-built
algorithms run eagerly: with ``async_op=True`` they return a completed Work.

Accounting (docs/design.md; what this rank sends, the way a ring moves it; S = the
full tensor's bytes, n = group size), ``pg.stats[op]["bytes"]``:

    all_reduce 2(n-1)/n*S   reduce_scatter, all_gather (n-1)/n*S
    broadcast, reduce (n-1)/n*S (a pipelined chain: n-1 of n ranks forward S)
    all_to_all (n-1)/n*S    send S, recv 0, barrier 0
    all_to_all_v  the rows this rank sends to the others: sum_{q != r} send_counts[q] * row bytes
                  (= (n-1)/n*S for equal counts, as all_to_all)

``pg.stats[op]["wire_bytes"]`` counts the bytes this rank really sent in the
hand-built algorithms and in send/isend (MPI's own collectives are opaque to
us: they add 0), so a lesson can set an algorithm beside the theory.
"""
from pdist.engine.backend import array_module, words
from pdist.comm import algorithms as alg, pair_async
from pdist.comm.algorithms import chunk_bounds


class Collectives:
    """Mixed into ProcessGroup: all_reduce, reduce_scatter, all_gather(_list), broadcast,
    reduce, all_to_all, barrier."""

    def all_reduce(self, buf, op="sum", algorithm=None, async_op=False):
        """buf <- buf_0 (op) ... (op) buf_{n-1} on every rank (op: sum, avg, max, min). Two
        ranks, a small NumPy buffer: one exchange carries the payload and its check (pair.py),
        blocking or async."""
        pre, pair = None, self._pair
        if pair is not None:
            slot = pair.fused(self, buf, op, algorithm, async_op and self.check)
            if slot is not None and not async_op:
                pre = self._settle(None) if self._pending else None
                if pre is None:
                    return pair.all_reduce(self, buf, op, slot)
            elif slot is not None and self.check:          # async: the payload rides on its check
                pre = self._settle(None, block=False) if self._pending else None
                if pre is None:
                    return pair_async.all_reduce_async(pair, self, buf, op, slot)
        flat, err = self._flat(buf, "all_reduce buf")
        err = pre or err or self._redop_error(op, buf.dtype)
        hand = {"naive": lambda t: alg.allreduce_naive(t, flat, op),
                "ring": lambda t: alg.allreduce_ring(t, flat, op)}
        return self._run("all_reduce", flat, self._ring_bytes(flat.nbytes, 2),
                         lambda c, nb: c.all_reduce(flat, op, nb), hand, algorithm, async_op, redop=op, error=err,
                         then=self._avg_then(op, flat), keep=(flat,))

    def reduce_scatter(self, out, inp, op="sum", algorithm=None, async_op=False):
        """out_r <- chunk_bounds(inp.size, n)[r] of (inp_0 (op) ... (op) inp_{n-1})."""
        fi, e1 = self._flat(inp, "reduce_scatter inp")
        fo, e2 = self._flat(out, "reduce_scatter out")
        bounds = chunk_bounds(fi.size, self.size)
        counts = [b - a for a, b in bounds]
        err = e1 or e2 or self._redop_error(op, inp.dtype)
        if not err and fo.size != counts[self.rank]:
            err = (f"out.size {fo.size} != its chunk of inp ({counts[self.rank]} of {fi.size} "
                   f"elements, chunk_bounds({fi.size}, {self.size})[{self.rank}])")
        if not err and out.dtype != inp.dtype:
            err = f"out.dtype {out.dtype} != inp.dtype {inp.dtype}"
        hand = {"naive": lambda t: alg.reduce_scatter_naive(t, fo, fi, op),
                "ring": lambda t: alg.reduce_scatter_ring(t, fo, fi, op)}
        return self._run("reduce_scatter", fi, self._ring_bytes(fi.nbytes),
                         lambda c, nb: c.reduce_scatter(fo, fi, counts, op, nb), hand, algorithm, async_op, redop=op, error=err,
                         then=self._avg_then(op, fo), keep=(fo, fi))

    def all_gather(self, out, inp, algorithm=None, async_op=False):
        """out[chunk_bounds(out.size, n)[q]] <- inp_q on every rank."""
        fi, e1 = self._flat(inp, "all_gather inp")
        fo, e2 = self._flat(out, "all_gather out")
        counts = [b - a for a, b in chunk_bounds(fo.size, self.size)]
        err = e1 or e2
        if not err and fi.size != counts[self.rank]:
            err = (f"inp.size {fi.size} != its chunk of out ({counts[self.rank]} of {fo.size} "
                   f"elements, chunk_bounds({fo.size}, {self.size})[{self.rank}])")
        if not err and out.dtype != inp.dtype:
            err = f"out.dtype {out.dtype} != inp.dtype {inp.dtype}"
        hand = {"naive": lambda t: alg.all_gather_naive(t, fo, fi),
                "ring": lambda t: alg.all_gather_ring(t, fo, fi)}
        return self._run("all_gather", fo, self._ring_bytes(fo.nbytes),
                         lambda c, nb: c.all_gather(fo, fi, counts, nb), hand, algorithm, async_op, error=err,
                         keep=(fo, fi))

    def all_gather_list(self, inp, algorithm=None):
        """[inp_0, ..., inp_{n-1}] (equal shapes) on every rank."""
        xp = array_module(inp)
        k = inp.size
        out = xp.empty(k * self.size, dtype=inp.dtype)
        self.all_gather(out, xp.ascontiguousarray(inp), algorithm=algorithm)
        return [out[q * k:(q + 1) * k].reshape(inp.shape) for q in range(self.size)]

    def broadcast(self, buf, src=0, algorithm=None, async_op=False):
        """buf_r <- buf_src on every rank."""
        flat, err = self._flat(buf, "broadcast buf")
        if not 0 <= src < self.size:
            err = err or f"src={src} is not a rank of a group of {self.size}"
        hand = {"naive": lambda t: alg.broadcast_naive(t, flat, src),
                "tree": lambda t: alg.broadcast_tree(t, flat, src)}
        return self._run("broadcast", flat, self._ring_bytes(flat.nbytes),
                         lambda c, nb: c.broadcast(flat, src, nb), hand, algorithm, async_op, root=src, error=err,
                         keep=(flat,))

    def reduce(self, buf, dst=0, op="sum", algorithm=None, async_op=False):
        """buf_dst <- buf_0 (op) ... (op) buf_{n-1}; buf elsewhere unchanged."""
        flat, err = self._flat(buf, "reduce buf")
        err = err or self._redop_error(op, buf.dtype)
        if not 0 <= dst < self.size:
            err = err or f"dst={dst} is not a rank of a group of {self.size}"
        hand = {"naive": lambda t: alg.reduce_naive(t, flat, dst, op),
                "tree": lambda t: alg.reduce_tree(t, flat, dst, op)}
        return self._run("reduce", flat, self._ring_bytes(flat.nbytes),
                         lambda c, nb: c.reduce(flat, dst, op, nb), hand, algorithm, async_op, redop=op, root=dst,
                         error=err, then=self._avg_then(op, flat, only_rank=dst), keep=(flat,))

    def all_to_all(self, out, inp, algorithm=None, async_op=False):
        """Axis-0 chunk q of inp goes to rank q; out's chunk q comes from rank q."""
        fi, e1 = self._flat(inp, "all_to_all inp")
        fo, e2 = self._flat(out, "all_to_all out")
        err = e1 or e2
        if not err and (inp.ndim == 0 or inp.shape[0] % self.size):
            err = f"inp.shape[0] ({inp.shape[0] if inp.ndim else 'scalar'}) must be divisible by {self.size}"
        if not err and (fo.size != fi.size or out.dtype != inp.dtype):
            err = f"out ({fo.size} x {out.dtype}) must match inp ({fi.size} x {inp.dtype})"
        return self._run("all_to_all", fi, self._ring_bytes(fi.nbytes),
                         lambda c, nb: c.all_to_all(fo, fi, nb),
                         {"pairwise": lambda t: alg.all_to_all_pairwise(t, fo, fi)}, algorithm, async_op, error=err,
                         keep=(fo, fi))

    def all_to_all_v(self, out, inp, send_counts, recv_counts, algorithm=None, async_op=False):
        """Variable all-to-all along axis 0 (MPI_Alltoallv): rows
        ``inp[sum(send_counts[:q]) : sum(send_counts[:q+1])]`` go to rank q, and
        ``out``'s block q (``recv_counts[q]`` rows, in rank order) comes from rank q.

        Contract: ``send_counts[q]`` on rank r equals ``recv_counts[r]`` on rank q (when
        the group's check is on, a mismatch raises CollectiveMismatchError on every rank,
        naming the pairs); rows are ``inp.shape[1:]``, equal to ``out.shape[1:]`` and on
        every rank; zeros are allowed. Accounted bytes: the rows sent to other ranks."""
        fi, e1 = self._flat(inp, "all_to_all_v inp")
        fo, e2 = self._flat(out, "all_to_all_v out")
        sc, rc, err = alg.counts_error(send_counts, recv_counts, inp, out, self.size)
        err = e1 or e2 or err
        row = alg.row_size(inp)
        if err:
            sc = rc = [0] * self.size
        sent = sum(c for q, c in enumerate(sc) if q != self.rank) * row * inp.itemsize
        ce, re_ = [c * row for c in sc], [c * row for c in rc]
        raw = (lambda a: a) if self._on_nccl(fo) else words      # MPI moves 2-byte floats as words
        return self._run("all_to_all_v", fi, sent, lambda c, nb: c.all_to_all_v(fo, fi, ce, re_, nb),
                         {"pairwise": lambda t: alg.all_to_all_v_pairwise(t, raw(fo), raw(fi), ce, re_)},
                         algorithm, async_op, error=err, keep=(fo, fi), fp_size=row,
                         verify=lambda: self._verify_counts(sc, rc))

    def barrier(self, async_op=False):
        """Return once every rank of the group has called barrier()."""
        return self._run("barrier", None, 0, lambda c, nb: c.barrier(nb), {}, "mpi", async_op)

