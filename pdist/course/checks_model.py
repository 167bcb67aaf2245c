"""Checks of exercises 06-10: tensor-parallel layers, vocab-parallel cross-entropy, and (in
checks_sched.py) the 1F1B schedule, resharding boxes and the hang (run through
pdist/course/checks.py)."""

import numpy as np

from pdist.course.checks_sched import checks_08, checks_09, checks_10  # noqa: F401  (the grader looks here)
from pdist.course.common import (close, need, ring_bytes, sub_groups)


def _regions(S, groups, rng):
    """f (CopyToTP) and g (ReduceFromTP) alone, on every group: f identity forward and sum
    backward, g sum forward; neither may change the array it is given (the copy hint)."""
    from pdist.engine.autograd import Tensor
    for g in groups:
        t, base = g.size, rng.standard_normal((3, 4))
        G = base * (g.rank + 1)
        kept = G.copy()
        y = S.CopyToTP.apply(Tensor(base.copy(), requires_grad=True), g)
        close(y.data, base, f"t = {t}: f's forward (the identity)")
        out = y._ctx.backward(G)
        out = out[0] if isinstance(out, tuple) else out
        need(np.array_equal(G, kept), f"t = {t}: f's backward changed the gradient array it was given: reduce "
                                      f"a copy (the same array can feed another branch of the graph)")
        close(out, base * t * (t + 1) / 2, f"t = {t}: f's backward (the sum of the ranks' gradients)")
        x = Tensor(G, requires_grad=True)
        y = S.ReduceFromTP.apply(x, g)
        need(np.array_equal(x.data, kept), f"t = {t}: g's forward changed its input array: reduce a copy")
        close(y.data, base * t * (t + 1) / 2, f"t = {t}: g's forward (the sum over the ranks)")


def _student_layers(S):
    """pdist's Column/RowParallelLinear with the student's forwards."""
    from pdist.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    class Col(ColumnParallelLinear):
        def forward(self, x):
            return S.column_parallel_forward(self, x)

    class Row(RowParallelLinear):
        def forward(self, x):
            return S.row_parallel_forward(self, x)

    return Col, Row


def checks_06(S, world):
    from pdist.engine import functional as F
    from pdist.engine.autograd import Tensor
    from pdist.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
    from pdist.parallel.tensor.regions import partition
    B, T, C, H = 2, 3, 12, 24                    # C and H divide by t = 1, 2, 3, 4
    rng = np.random.default_rng(1)
    A, a = rng.standard_normal((C, H)), rng.standard_normal(H)
    W, w = rng.standard_normal((H, C)), rng.standard_normal(C)
    X, R = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    groups = sub_groups(world)                   # t = 2 (twice), 3 and 1, then the world (4)

    Col, Row = _student_layers(S)

    def mlp(col, row):
        x = Tensor(X.copy(), requires_grad=True)
        y = row(F.gelu(col(x)))
        ((y * Tensor(R)).sum()).backward()
        return x, y

    def layers(cls_c, cls_r, g):
        return (cls_c(C, H, gather_output=False, group=g, master_weight=A, master_bias=a, dtype="float64"),
                cls_r(H, C, input_is_parallel=True, group=g, master_weight=W, master_bias=w, dtype="float64"))

    def equal():
        for g in groups:
            t, r = g.size, g.rank
            col, row = layers(Col, Row, g)
            x, y = mlp(col, row)
            ref = [Tensor(v.copy(), requires_grad=True) for v in (A, a, W, w)]
            xr = Tensor(X.copy(), requires_grad=True)
            yr = F.linear(F.gelu(F.linear(xr, ref[0], ref[1])), ref[2], ref[3])
            ((yr * Tensor(R)).sum()).backward()
            close(y.data, yr.data, f"t = {t}: the MLP's output Y")
            close(x.grad, xr.grad, f"t = {t}: dL/dX (the gradient of the MLP's input)")
            close(col.weight.grad, partition(ref[0].grad, 1, r, t), f"t = {t}: the column layer's weight gradient")
            close(col.bias.grad, partition(ref[1].grad, 0, r, t), f"t = {t}: the column layer's bias gradient")
            close(row.weight.grad, partition(ref[2].grad, 0, r, t), f"t = {t}: the row layer's weight gradient")
            close(row.bias.grad, ref[3].grad, f"t = {t}: the row layer's bias gradient")

    def comm():
        col, row = layers(Col, Row, world)
        world.reset_stats()
        mlp(col, row)
        mine = dict(world.stats)
        pc, pr = layers(ColumnParallelLinear, RowParallelLinear, world)
        world.reset_stats()
        mlp(pc, pr)
        theirs = world.stats
        calls = mine.get("all_reduce", {}).get("calls", 0)
        need({k: v["bytes"] for k, v in mine.items()} == {k: v["bytes"] for k, v in theirs.items()} and calls == 2,
             f"forward + backward of the MLP made {calls} all-reduces ({mine.get('all_reduce', {}).get('bytes', 0)} "
             f"bytes); Megatron's f and g make 2 (one in forward, one in backward) of B*T*C values each")

    return [("f and g: identity / sum, and they never change the arrays they are given", lambda: _regions(S, groups, rng)),
            ("the TP MLP equals the single-process MLP at t = 1..4 (output and every gradient)", equal),
            ("one all-reduce forward, one backward (like pdist's layers)", comm)]


# ------------------------------------------------------------------ 07 vocab-parallel cross-entropy
def checks_07(S, world):
    from pdist.engine.autograd import Tensor
    from pdist.engine.backend import xp
    from pdist.parallel.tensor.layers import vocab_parallel_cross_entropy
    groups = sub_groups(world, (2,))             # t = 2 (and 1), then the world (3)

    def problem(t, boundary):
        """(N, V, logits, targets): targets on the slice boundaries, or random ones off them."""
        V, v, rng = 8 * t, 8, np.random.default_rng([2, t, boundary])    # the same on every rank of a group
        edges = sorted({e for q in range(t + 1) for e in (q * v - 1, q * v) if 0 <= e < V})
        y = np.array(edges) if boundary else rng.choice([i for i in range(V) if i not in edges], 6)
        return len(y), V, rng.standard_normal((len(y), V)) * 3, y

    def case(what, boundary=False, shift=0.0):
        for g in groups:
            N, V, Z, y = problem(g.size, boundary)
            Z = Z + shift
            v = V // g.size
            start = g.rank * v
            rows, probs = S.vocab_parallel_ce_forward(xp.asarray(Z[:, start:start + v].copy()), xp.asarray(y),
                                                      start, g)
            zm = Z - Z.max(1, keepdims=True)
            want = np.log(np.exp(zm).sum(1)) - zm[np.arange(N), y]
            close(rows, want, f"t = {g.size}, {what}: the loss of each row")
            scale = np.linspace(0.5, 1.5, N) / N
            grad = S.vocab_parallel_ce_backward(probs, xp.asarray(y), start, xp.asarray(scale))
            d = np.exp(zm) / np.exp(zm).sum(1, keepdims=True)
            d[np.arange(N), y] -= 1.0
            close(grad, (d * scale[:, None])[:, start:start + v], f"t = {g.size}, {what}: dL/dlogits on this "
                  f"rank's vocabulary slice (softmax - onehot, times dL/dloss_n = grad_rows)")
            if not boundary and not shift:           # and pdist's own vocab-parallel cross-entropy agrees
                lt = Tensor(xp.asarray(Z[:, start:start + v].copy()), requires_grad=True)
                vocab_parallel_cross_entropy(lt, xp.asarray(y), g, start).backward()
                grad = S.vocab_parallel_ce_backward(probs, xp.asarray(y), start, xp.full(N, 1.0 / N))
                close(grad, lt.grad, f"t = {g.size}, {what}: dL/dlogits of the mean loss")

    def bytes_sent():
        N, V, Z, y = problem(world.size, False)
        v = V // world.size
        start = world.rank * v
        world.reset_stats()
        S.vocab_parallel_ce_forward(xp.asarray(Z[:, start:start + v].copy()), xp.asarray(y), start, world)
        got = world.bytes_sent()
        need(got <= 3 * ring_bytes(N * 8, world.size, 2) and "all_gather" not in world.stats,
             f"forward sent {got} bytes: only per-row numbers (max, sum of exp, target logit) may travel, "
             f"never the logits")

    return [("equals the full softmax cross-entropy (t = 1, 2, 3)", lambda: case("random logits")),
            ("targets on every slice boundary (first and last id of each rank)",
             lambda: case("targets on slice boundaries", boundary=True)),
            ("stable for large logits (1000 + z)", lambda: case("large logits", shift=1000.0)),
            ("sends O(N) bytes, never the logits", bytes_sent)]
