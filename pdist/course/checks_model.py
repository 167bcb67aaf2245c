"""Checks of exercises 06-10: tensor-parallel layers, vocab-parallel cross-entropy, the
1F1B schedule, resharding boxes and the hang (run through pdist/course/checks.py)."""

import numpy as np

from pdist.course.common import (SEED, CheckFailed, close, close_dicts, need, ring_bytes)


def checks_06(S, world):
    from pdist.engine import functional as F
    from pdist.engine.autograd import Tensor
    from pdist.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
    from pdist.parallel.tensor.regions import partition
    t, r = world.size, world.rank
    B, T, C, H = 2, 3, 8, 16
    rng = np.random.default_rng(1)
    A, a = rng.standard_normal((C, H)), rng.standard_normal(H)
    W, w = rng.standard_normal((H, C)), rng.standard_normal(C)
    X, R = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))

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

    def layers(cls_c, cls_r):
        return (cls_c(C, H, gather_output=False, group=world, master_weight=A, master_bias=a, dtype="float64"),
                cls_r(H, C, input_is_parallel=True, group=world, master_weight=W, master_bias=w, dtype="float64"))

    def equal():
        col, row = layers(Col, Row)
        x, y = mlp(col, row)
        ref = [Tensor(v.copy(), requires_grad=True) for v in (A, a, W, w)]
        xr = Tensor(X.copy(), requires_grad=True)
        yr = F.linear(F.gelu(F.linear(xr, ref[0], ref[1])), ref[2], ref[3])
        ((yr * Tensor(R)).sum()).backward()
        close(y.data, yr.data, "the MLP's output Y")
        close(x.grad, xr.grad, "dL/dX (the gradient of the MLP's input)")
        close(col.weight.grad, partition(ref[0].grad, 1, r, t), "the column layer's weight gradient")
        close(col.bias.grad, partition(ref[1].grad, 0, r, t), "the column layer's bias gradient")
        close(row.weight.grad, partition(ref[2].grad, 0, r, t), "the row layer's weight gradient")
        close(row.bias.grad, ref[3].grad, "the row layer's bias gradient")

    def comm():
        col, row = layers(Col, Row)
        world.reset_stats()
        mlp(col, row)
        mine = dict(world.stats)
        pc, pr = layers(ColumnParallelLinear, RowParallelLinear)
        world.reset_stats()
        mlp(pc, pr)
        theirs = world.stats
        calls = mine.get("all_reduce", {}).get("calls", 0)
        need({k: v["bytes"] for k, v in mine.items()} == {k: v["bytes"] for k, v in theirs.items()} and calls == 2,
             f"forward + backward of the MLP made {calls} all-reduces ({mine.get('all_reduce', {}).get('bytes', 0)} "
             f"bytes); Megatron's f and g make 2 (one in forward, one in backward) of B*T*C values each")

    return [("the TP MLP equals the single-process MLP (output and every gradient)", equal),
            ("one all-reduce forward, one backward (like pdist's layers)", comm)]


# ------------------------------------------------------------------ 07 vocab-parallel cross-entropy
def checks_07(S, world):
    from pdist.engine.autograd import Tensor
    from pdist.engine.backend import xp
    from pdist.parallel.tensor.layers import vocab_parallel_cross_entropy
    t, r = world.size, world.rank
    N, V = 6, 8 * t
    rng = np.random.default_rng(2)
    Z = rng.standard_normal((N, V)) * 3
    y = rng.integers(0, V, N)
    y[0], y[1] = 0, V - 1
    v = V // t
    start = r * v

    def case(Zfull, what):
        mine = xp.asarray(Zfull[:, start:start + v].copy())
        rows, probs = S.vocab_parallel_ce_forward(mine, xp.asarray(y), start, world)
        zm = Zfull - Zfull.max(1, keepdims=True)
        want = np.log(np.exp(zm).sum(1)) - zm[np.arange(N), y]
        close(rows, want, f"{what}: the loss of each row")
        grad = S.vocab_parallel_ce_backward(probs, xp.asarray(y), start, xp.full(N, 1.0 / N))
        lt = Tensor(xp.asarray(Zfull[:, start:start + v].copy()), requires_grad=True)
        vocab_parallel_cross_entropy(lt, xp.asarray(y), world, start).backward()
        close(grad, lt.grad, f"{what}: dL/dlogits on this rank's vocabulary slice")

    def bytes_sent():
        world.reset_stats()
        S.vocab_parallel_ce_forward(xp.asarray(Z[:, start:start + v].copy()), xp.asarray(y), start, world)
        got = world.bytes_sent()
        need(got <= 3 * ring_bytes(N * 8, t, 2) and "all_gather" not in world.stats,
             f"forward sent {got} bytes: only per-row numbers (max, sum of exp, target logit) may travel, "
             f"never the logits")

    return [("equals the full softmax cross-entropy", lambda: case(Z, "random logits")),
            ("stable for large logits (1000 + z)", lambda: case(Z + 1000.0, "large logits")),
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
