"""Checks of exercises 06-10: tensor-parallel layers, vocab-parallel cross-entropy, the
1F1B schedule, resharding boxes and the hang (run through pdist/course/checks.py)."""

import numpy as np

from pdist.course.common import (SEED, CheckFailed, close, close_dicts, need, ring_bytes, sub_groups)


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

    class Col(ColumnParallelLinear):
        def forward(self, x):
            return S.column_parallel_forward(self, x)

    class Row(RowParallelLinear):
        def forward(self, x):
            return S.row_parallel_forward(self, x)

    def mlp(col, row):
        x = Tensor(X.copy(), requires_grad=True)
        y = row(F.gelu(col(x)))
        ((y * Tensor(R)).sum()).backward()
        return x, y

    def layers(cls_c, cls_r, g):
        return (cls_c(C, H, gather_output=False, group=g, master_weight=A, master_bias=a, dtype="float64"),
                cls_r(H, C, input_is_parallel=True, group=g, master_weight=W, master_bias=w, dtype="float64"))

    def regions():
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

    return [("f and g: identity / sum, and they never change the arrays they are given", regions),
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


# ------------------------------------------------------------------ 08 1F1B as data
def checks_08(S, world):
    from pdist.parallel.pipeline import schedules as sch
    from pdist.parallel.pipeline import simulate as sim

    def valid():
        for p in (1, 2, 3, 4):
            for m in (1, 2, p, 2 * p + 1):
                try:
                    sim.check_schedule(S.one_f_one_b(p, m), m)
                except (AssertionError, sch.DeadlockError) as e:
                    raise CheckFailed(f"p={p}, m={m}: the schedule checker says: {e}") from None

    def bubble():
        for p, m in ((2, 4), (4, 4), (4, 8), (3, 5)):
            spans = sim.simulate(S.one_f_one_b(p, m))
            got = max(sim.bubble_fraction(spans))
            want = sim.theoretical_bubble(p, m)
            need(abs(got - want) < 1e-12, f"p={p}, m={m}: simulated bubble {got:.4f}, theory (p-1)/(m+p-1) = {want:.4f}")

    def stash():
        for p, m in ((2, 4), (4, 8), (4, 2), (3, 5)):
            peaks = sim.check_schedule(S.one_f_one_b(p, m), m)
            want = [min(p - s, m) for s in range(p)]
            need(peaks == want, f"p={p}, m={m}: peak stash per stage {peaks}; 1F1B holds at most "
                                f"min(p-s, m) = {want} (check the warm-up count)")

    return [("the schedule checker accepts it (p 1..4, several m)", valid),
            ("simulated bubble = (p-1)/(m+p-1)", bubble), ("peak stash = min(p - s, m)", stash)]


# ------------------------------------------------------------------ 09 resharding reads
def checks_09(S, world):
    from pdist.parallel.layout import flat_boxes

    rng = np.random.default_rng(3)

    def saved_layouts(shape):
        """Boxes a few layouts would save: TP blocks, ZeRO flat shards (partial rows)."""
        out = []
        for k in (1, 2, 3):
            size = int(np.prod(shape))
            cuts = np.linspace(0, size, k + 1).astype(int)
            boxes = []
            for a, b in zip(cuts[:-1], cuts[1:]):
                boxes += [{"offsets": list(o), "shape": list(s)} for _, o, s in flat_boxes(shape, a, b)]
            out.append(boxes)
        if len(shape) == 2 and shape[0] % 2 == 0:
            h = shape[0] // 2
            out.append([{"offsets": [0, 0], "shape": [h, shape[1]]}, {"offsets": [h, 0], "shape": [h, shape[1]]}])
        return out

    def targets(shape):
        for _ in range(25):
            lo = [int(rng.integers(0, d)) for d in shape]
            yield lo, [int(rng.integers(1, d - low + 1)) for low, d in zip(lo, shape)]
        yield [0] * len(shape), list(shape)

    def assemble():
        for shape in ((7,), (4, 6), (3, 5, 2)):
            full = rng.standard_normal(shape)
            for saved in saved_layouts(shape):
                parts = [full[tuple(slice(o, o + s) for o, s in zip(b["offsets"], b["shape"]))] for b in saved]
                for off, shp in targets(shape):
                    out = np.full(shp, np.nan)
                    plan = S.plan_reads(saved, off, shp)
                    for i, src, dst in plan:
                        piece = parts[i][src]
                        need(all(x > 0 for x in piece.shape), f"shape {shape}, target {off}+{shp}: the plan "
                             f"reads an empty slice of saved box {i} (skip boxes that do not overlap)")
                        out[dst] = piece
                    want = full[tuple(slice(o, o + s) for o, s in zip(off, shp))]
                    need(not np.isnan(out).any() and np.array_equal(out, want),
                         f"shape {shape}, target {off}+{shp}: assembling the plan does not give the target box")
                    overl = sum(all(max(o, b) < min(o + s, b + k) for o, s, b, k in
                                    zip(off, shp, sv["offsets"], sv["shape"])) for sv in saved)
                    need(len(plan) == overl, f"shape {shape}, target {off}+{shp}: {len(plan)} reads, "
                         f"{overl} saved boxes overlap the target")

    return [("assembles every target box from the saved boxes it overlaps", assemble)]


# ------------------------------------------------------------------ 10 find the hang
def checks_10(S, world):
    from pdist.course import lesson
    from pdist import nn
    from pdist.data import regression_batch

    def build():
        rng = np.random.default_rng(5)
        return nn.Sequential(nn.Linear(6, 16, rng=rng, dtype="float64"), nn.GELU(),
                             nn.Linear(16, 3, rng=rng, dtype="float64"))

    def get(step):
        return regression_batch(8, 6, 3, SEED, step)

    def equal():
        steps = 4
        ref = build()
        opt = lesson.make_adamw(ref.parameters())
        ref_losses = []
        for step in range(steps):
            x, y = get(step)
            loss = nn.mse_loss(ref(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        model = build()
        losses = S.fixed_train(model, lesson.make_adamw(model.parameters()), world, get, steps)
        close(losses, ref_losses, "the loss per step (the global-batch mean, on every rank)")
        close_dicts(model.state_dict(), ref.state_dict(), f"after {steps} steps the parameters")

    return [("runs on every rank and equals single-process training", equal)]
