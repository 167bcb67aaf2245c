"""Checks of exercises 08 (1F1B as data), 09 (resharding reads), 10 (find the hang) and 13
(ZB-H1 as data), run through pdist/course/checks.py."""
import numpy as np

from pdist.course.common import SEED, CheckFailed, close, close_dicts, need, sub_groups


# ------------------------------------------------------------------ 08 1F1B as data
def checks_08(S, world):
    from pdist.parallel.pipeline import schedules as sch
    from pdist.parallel.pipeline import simulate as sim

    def valid():
        for p in (1, 2, 3, 4):
            for m in sorted({1, 2, max(p - 1, 1), p, 2 * p + 1}):    # m = p - 1: warm-up = min(p-s-1, m) at its edge
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
    from pdist import nn, optim
    from pdist.data import regression_batch

    def build():
        rng = np.random.default_rng(5)
        return nn.Sequential(nn.Linear(6, 16, rng=rng, dtype="float64"), nn.GELU(),
                             nn.Linear(16, 3, rng=rng, dtype="float64"))

    def get(step):
        return regression_batch(8, 6, 3, SEED, step)

    def reference(steps):
        """Losses and parameters of one process on the whole batch, with SGD (so a summed gradient
        moves the weights n times as far: no optimizer hides it)."""
        ref = build()
        opt = optim.SGD(ref.parameters(), lr=0.05)
        losses = []
        for step in range(steps):
            x, y = get(step)
            loss = nn.mse_loss(ref(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, ref.state_dict()

    def equal():
        steps = 4
        ref_losses, ref_sd = reference(steps)
        for g in sub_groups(world, (2,)):
            model = build()
            losses = S.fixed_train(model, optim.SGD(model.parameters(), lr=0.05), g, get, steps)
            close(losses, ref_losses, f"n = {g.size}: the loss per step (the global-batch mean, on every rank)")
            close_dicts(model.state_dict(), ref_sd, f"n = {g.size}: after {steps} SGD steps the parameters")

    def adamw():
        model = build()
        losses = S.fixed_train(model, lesson.make_adamw(model.parameters()), world, get, 4)
        need(len(losses) == 4, f"fixed_train returned {len(losses)} losses for 4 steps")

    return [("runs on every rank and equals single-process training (n = 2 and 4, SGD)", equal),
            ("runs with AdamW too (the lesson's optimizer)", adamw)]


# ------------------------------------------------------------------ 13 ZB-H1 as data
def _w_while_b_ready(spans, p):
    """(stage, W, B) for the first W that ran while a B of its stage, run later, was ready (its
    forward done, its gradient arrived): that B, and the previous stage's, waited on the W."""
    from pdist.parallel.pipeline.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
    end = {(s, i.op, i.mb): e for s in range(p) for i, _, e in spans[s]}
    for s in range(p):
        for w, t0, t1 in spans[s]:
            if w.op != BACKWARD_WEIGHT:
                continue
            for b, b0, _ in spans[s]:
                ready = max(end[(s, FORWARD, b.mb)], end.get((s + 1, BACKWARD_INPUT, b.mb), 0.0))
                if b.op == BACKWARD_INPUT and b0 >= t1 and ready <= t0:
                    return s, w, b
    return None


def _bubble_why(progs, spans, p, m):
    """Where a schedule's extra idle comes from: a short warm-up, a W run while a B was ready,
    or else the idle per stage."""
    from pdist.parallel.pipeline.schedules import BACKWARD_INPUT, FORWARD
    for s, prog in enumerate(progs):
        ops = [i.op for i in prog if i.op in (FORWARD, BACKWARD_INPUT)]
        warm = ops.index(BACKWARD_INPUT) - 1 if BACKWARD_INPUT in ops else len(ops)
        if warm < min(p - s - 1, m):
            return (f"stage {s} runs {warm} warm-up forward(s) before its first F-B pair, 1F1B's warm-up is "
                    f"min(p-s-1, m) = {min(p - s - 1, m)} (too few warm-up steps)")
    why = _w_while_b_ready(spans, p)
    if why:
        return f"stage {why[0]} runs {why[1]!r} while {why[2]!r} is ready: that B (and the stages before) wait on a W"
    end = max(e for r in spans for _, _, e in r)
    idle = [round(end - sum(e - b for _, b, e in r), 6) for r in spans]
    return f"idle per stage {idle} t_F, ZB-H1's p-1 = {p - 1} each (which W's could fill the idle slots?)"


def checks_13(S, world):
    from pdist.parallel.pipeline import schedules as sch
    from pdist.parallel.pipeline import simulate as sim

    def valid():
        for p in (1, 2, 3, 4):
            for m in sorted({1, 2, max(p - 1, 1), p, 2 * p + 1}):
                progs = S.zb_h1(p, m)
                whole = next(((s, i) for s, prog in enumerate(progs) for i in prog if i.op == sch.BACKWARD), None)
                need(whole is None, f"p={p}, m={m}: stage {whole and whole[0]} runs a whole BACKWARD "
                                    f"({whole and whole[1]}): split every backward into BACKWARD_INPUT and BACKWARD_WEIGHT")
                try:
                    sim.check_schedule(progs, m)
                    sim.simulate_rendezvous(progs)
                except (AssertionError, sch.DeadlockError) as e:
                    raise CheckFailed(f"p={p}, m={m}: the schedule checker says: {e}") from None

    def memory():
        for p, m in ((2, 4), (4, 8), (4, 2), (3, 5)):
            peaks = sim.check_schedule(S.zb_h1(p, m), m)
            need(max(peaks) <= min(p, m), f"p={p}, m={m}: peak stash per stage {peaks}: more than 1F1B's peak "
                                          f"min(p, m) = {min(p, m)} (a W kept back holds its micro-batch: keep fewer back)")

    def bubble():
        for p, m in ((2, 4), (4, 4), (4, 8), (3, 5)):
            progs = S.zb_h1(p, m)
            spans = sim.simulate(progs, t_w=1.0)
            got, want = max(sim.bubble_fraction(spans)), sim.theoretical_bubble(p, m, schedule="zb-h1")
            need(abs(got - want) < 1e-12, f"p={p}, m={m}: simulated bubble {got:.4f} (t_F = t_B = t_W), ZB-H1's "
                                          f"(p-1)/(3m+p-1) = {want:.4f}; " + _bubble_why(progs, spans, p, m))

    return [("the schedule checker accepts it, every backward split in B and W (p 1..4, several m)", valid),
            ("peak stash <= 1F1B's min(p, m)", memory), ("simulated bubble = (p-1)/(3m+p-1)", bubble)]
