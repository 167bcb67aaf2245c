"""The checks of each course exercise, run under mpiexec by the grader (pdist/grade.py).

    python -m pdist.testing pdist/grade_checks.py EXERCISE SOURCE

SOURCE is a student's exercise file, or ``reference`` (pdist/exercise_solutions.py).
Every check compares the student's function, plugged into pdist's machinery, with pdist's
own implementation: equality with single-process training (float64, rtol 1e-9), bytes
sent (``group.stats``, the ring accounting of docs/design.md), no hang (the watchdog,
``PDIST_TIMEOUT``). Each rank prints one ``report`` per check; on the first failure it
reports why and exits, so the grader (which reads the reports) shows the first failing
check. Messages say what differs, never what the answer is.
"""
import importlib.util
import os
import sys
import time
import traceback
from types import SimpleNamespace

import numpy as np

RTOL = 1e-9
SEED, STEPS, BATCH = 0, 3, 12


class CheckFailed(AssertionError):
    pass


def need(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def load(source):
    if source == "reference":
        from pdist import exercise_solutions
        return exercise_solutions
    spec = importlib.util.spec_from_file_location("student_exercise", source)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(source)))
    spec.loader.exec_module(mod)
    return mod


def close(a, b, what, rtol=RTOL, atol=1e-12):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    need(a.shape == b.shape, f"{what}: shape {a.shape}, expected {b.shape}")
    if not np.allclose(a, b, rtol=rtol, atol=atol):
        err = np.max(np.abs(a - b) / (np.abs(b) + 1e-300)) if a.size else 0.0
        raise CheckFailed(f"{what} differs from pdist's (max relative error {err:.2g})")


def close_dicts(got, want, what):
    need(set(got) == set(want), f"{what}: tensor names differ")
    for k in want:
        close(got[k], want[k], f"{what}: {k}")


# ------------------------------------------------------------------ shared harness
def tiny_cfg():
    from pdist import data
    from pdist.gpt import GPTConfig
    tokens, tok = data.char_dataset(20_000)
    return GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=16,
                     dtype="float64"), tokens


def batches(cfg, tokens, batch=BATCH):
    from pdist import data
    return lambda step: data.get_batch(tokens, batch, cfg.block_size, SEED, step)


def reference_run(cfg, tokens, steps=STEPS, batch=BATCH):
    """(losses, state_dict) of single-process training: pdist's own, through the one loop."""
    from pdist import gpt, lesson
    from pdist.parallel.base import Local
    from pdist.training import train
    model = Local(gpt.GPT(cfg, seed=SEED))
    losses = train(model, lesson.make_adamw(model.parameters()), batches(cfg, tokens, batch), steps)
    return losses, model.module.state_dict()


def train_strategy(model, cfg, tokens, steps=STEPS, on_step=None):
    from pdist import lesson
    from pdist.training import train
    return train(model, lesson.make_adamw(model.parameters()), batches(cfg, tokens), steps, on_step=on_step)


def ring_bytes(nbytes, n, factor=1):
    return factor * (n - 1) * nbytes // n


# ------------------------------------------------------------------ 01 ring all-reduce
def checks_01(S, world):
    from pdist.backend import xp
    n, r = world.size, world.rank

    def values(size, q):
        return np.random.default_rng([size, q]).standard_normal(size)

    def run(size):
        buf = xp.asarray(values(size, r))
        S.ring_all_reduce(world, buf)
        return buf, sum(values(size, q) for q in range(n))

    def small():
        for size in (n * 4, 1, n - 1 or 1, 7 * n + 3):
            got, want = run(size)
            close(got, want, f"the sum of a {size}-element buffer", rtol=1e-12)

    def big():
        got, want = run(1 << 20)       # 8 MiB: each chunk is past MPI's eager limit
        close(got, want, "the sum of a 2^20-element buffer", rtol=1e-12)

    def bytes_sent():
        world.reset_stats()
        size = 64 * n
        run(size)
        sent = world.stats.get("send", {}).get("bytes", 0)
        want = ring_bytes(size * 8, n, 2)
        need(sent == want, f"rank {r} sent {sent} bytes for S = {size * 8}; a ring sends 2(n-1)/n*S = {want}")
        others = [k for k in world.stats if k not in ("send", "recv")]
        need(not others, f"use only point-to-point calls (found {others})")

    return [("sums small and uneven buffers", small), ("sums an 8 MiB buffer (no deadlock)", big),
            ("sends 2(n-1)/n*S bytes", bytes_sent)]


# ------------------------------------------------------------------ 02 data parallelism by hand
def checks_02(S, world):
    from pdist import gpt
    from pdist.parallel.base import Local
    from pdist.parallel.data_parallel import DataParallelNaive
    cfg, tokens = tiny_cfg()

    class HandLocal(Local):
        def compute(self, x, y):
            return S.accumulate_gradients(self.module, x, y, self.microbatches)

    class HandDP(DataParallelNaive):
        def finish_grad_sync(self):
            self.inner.finish_grad_sync()
            S.average_gradients(self._param_list, self.group)

    def equal(k):
        ref_losses, ref_sd = reference_run(cfg, tokens)
        model = HandDP(HandLocal(gpt.GPT(cfg, seed=SEED), microbatches=k), world)
        losses = train_strategy(model, cfg, tokens)
        close(losses, ref_losses, "the loss per step")
        close_dicts(model.full_state_dict(), ref_sd, f"after {STEPS} steps the parameters")

    def bytes_sent():
        model = HandDP(Local(gpt.GPT(cfg, seed=SEED)), world)
        world.reset_stats()
        train_strategy(model, cfg, tokens, steps=1)
        got = world.bytes_sent()
        want = sum(ring_bytes(p.data.nbytes, world.size, 2) for p in model.parameters())
        need(got == want, f"one step sent {got} bytes; all-reducing every gradient once is 2(n-1)/n*Psi*b = {want}")

    return [("equals single-process training", lambda: equal(1)), ("sends 2(n-1)/n*Psi*b per step", bytes_sent),
            ("gradient accumulation (k = 2) equals single-process training", lambda: equal(2))]


# ------------------------------------------------------------------ 03 bucketed DDP
def checks_03(S, world):
    from pdist import gpt
    from pdist.backend import xp
    from pdist.parallel.base import Local
    from pdist.parallel.data_parallel import _DataParallelBase, build_buckets
    cfg, tokens = tiny_cfg()
    CAP = 8 * 1024

    class HandDDP(_DataParallelBase):
        def __init__(self, module, group):
            super().__init__(module, group)
            groups = S.make_buckets(self._param_list, CAP)
            self.buckets = []
            for i, ps in enumerate(groups):
                buf = xp.zeros(sum(p.size for p in ps), dtype=ps[0].dtype)
                views, off = {}, 0
                for p in ps:
                    views[id(p)] = buf[off:off + p.size].reshape(p.shape)
                    off += p.size
                self.buckets.append(SimpleNamespace(index=i, params=ps, buffer=buf, views=views,
                                                    ready=set(), work=None))
            self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
            self.next, self.issued_in_backward = 0, 0
            for p in self._param_list:
                p.register_post_accumulate_grad_hook(self._hook)
            self.zero_grad()

        def _view(self, p):
            b = self.bucket_of[id(p)]
            v = b.views[id(p)]
            if p.grad is not v:
                v[...] = 0 if p.grad is None else p.grad
                p.grad = v

        def _hook(self, p):
            self._view(p)
            before = self.next
            S.on_grad_ready(self, p)
            self.issued_in_backward += self.next - before

        def finish_grad_sync(self):
            self.inner.finish_grad_sync()
            for p in self._param_list:
                self._view(p)
            S.finish_grad_sync(self)

        def zero_grad(self):
            self.inner.zero_grad()
            for b in self.buckets:
                b.buffer[...] = 0
            for p in self._param_list:
                self._view(p)

    def buckets():
        model = gpt.GPT(cfg, seed=SEED)
        params = [p for _, p in model.named_parameters()]
        got = S.make_buckets(params, CAP)
        flat = [id(p) for b in got for p in b]
        need(sorted(flat) == sorted(id(p) for p in params) and len(flat) == len(params),
             "every parameter must be in exactly one bucket")
        want = build_buckets(params, CAP, CAP)
        need([[id(p) for p in b] for b in got] == [[id(p) for p in b] for b in want],
             f"buckets differ from DDP's ({len(got)} vs {len(want)}; walk the parameters in the order "
             f"backward produces their gradients, and close a bucket before it passes the cap)")

    def equal():
        ref_losses, ref_sd = reference_run(cfg, tokens)
        model = HandDDP(Local(gpt.GPT(cfg, seed=SEED)), world)
        losses = train_strategy(model, cfg, tokens)
        close(losses, ref_losses, "the loss per step")
        close_dicts(model.full_state_dict(), ref_sd, f"after {STEPS} steps the parameters")
        need(all(b.work is None and not b.ready for b in model.buckets) and model.next == 0,
             "after finish_grad_sync every bucket must be waited on and reset for the next step")

    def overlap_and_bytes():
        model = HandDDP(Local(gpt.GPT(cfg, seed=SEED)), world)
        world.reset_stats()
        train_strategy(model, cfg, tokens, steps=1)
        need(model.issued_in_backward >= len(model.buckets) - 1,
             f"only {model.issued_in_backward} of {len(model.buckets)} buckets were issued during backward: "
             f"issue a bucket from the hook as soon as it (and every bucket before it) is complete")
        got = world.bytes_sent()
        want = sum(ring_bytes(b.buffer.nbytes, world.size, 2) for b in model.buckets)
        need(got == want, f"one step sent {got} bytes; one all-reduce per bucket is {want}")
        ar = world.stats.get("all_reduce", {}).get("calls", 0)
        need(ar == len(model.buckets), f"{ar} all-reduces for {len(model.buckets)} buckets")

    return [("buckets are DDP's", buckets), ("equals single-process training", equal),
            ("overlaps backward; one all-reduce per bucket", overlap_and_bytes)]


# ------------------------------------------------------------------ 04 ZeRO-1
def checks_04(S, world):
    from pdist import gpt, lesson
    from pdist.autograd import Tensor
    from pdist.backend import xp
    from pdist.comm.algorithms import chunk_bounds
    from pdist.data import shard
    cfg, tokens = tiny_cfg()
    n, r = world.size, world.rank

    def run():
        model = gpt.GPT(cfg, seed=SEED)
        params = [p for _, p in model.named_parameters()]
        psi = sum(p.size for p in params)
        flat_p, flat_g = xp.zeros(psi), xp.zeros(psi)
        off = 0
        for p in params:
            flat_p[off:off + p.size] = p.data.reshape(-1)
            p.data = flat_p[off:off + p.size].reshape(p.shape)
            off += p.size
        a, b = chunk_bounds(psi, n)[r]
        sh = Tensor(flat_p[a:b].copy(), requires_grad=True, name="shard")
        opt = lesson.make_adamw([sh])
        get = batches(cfg, tokens)
        world.reset_stats()
        for step in range(STEPS):
            flat_g[...] = 0
            off = 0
            for p in params:
                p.grad = flat_g[off:off + p.size].reshape(p.shape)
                off += p.size
            x, y = shard(get(step), r, n)
            _, loss = model(x, y)
            loss.backward()
            S.zero1_step(flat_p, flat_g, sh, opt, world)
        return model, psi, sh, opt

    def equal():
        _, ref_sd = reference_run(cfg, tokens)
        model, _, _, _ = run()
        close_dicts({k: v for k, v in model.state_dict().items() if k in ref_sd}, ref_sd,
                    f"after {STEPS} steps the parameters")

    def bytes_and_memory():
        _, psi, sh, opt = run()
        want = ring_bytes(psi * 8, n) * STEPS
        rs = world.stats.get("reduce_scatter", {}).get("bytes", 0)
        ag = world.stats.get("all_gather", {}).get("bytes", 0)
        need("all_reduce" not in world.stats,
             "ZeRO-1 never all-reduces the gradients: reduce-scatter them (each rank needs only its shard)")
        need(rs == want and ag == want,
             f"per step: reduce-scatter {rs // STEPS} and all-gather {ag // STEPS} bytes; each should be "
             f"(n-1)/n*Psi*b = {want // STEPS} (2 Psi in all, like DDP)")
        need(opt.state_bytes() == 2 * sh.data.nbytes,
             f"Adam state {opt.state_bytes()} bytes on this rank; it should be 2 x the shard ({2 * sh.data.nbytes})")

    return [("equals single-process training", equal),
            ("reduce-scatter + all-gather: 2(n-1)/n*Psi*b; Adam state only for the shard", bytes_and_memory)]


# ------------------------------------------------------------------ 05 ZeRO-3, one unit
def checks_05(S, world):
    from pdist import gpt
    from pdist.parallel.base import Local
    from pdist.parallel.zero import ZeRO
    cfg, tokens = tiny_cfg()
    n = world.size

    class HandZeRO3(ZeRO):
        def __init__(self, module, group):
            super().__init__(module, 3, group, prefetch=False)
            for u in self.units:
                u.free = (lambda u=u: S.free_unit(u))
            self.gathers = 0

        def _gather(self, u, order):
            if not u.materialized():
                S.gather_unit(u, self.group)
                self.gathers += 1
                need(u.materialized() and all(p.data.shape == s for p, s in zip(u.params, u.shapes)),
                     "after gather_unit every parameter must have its full shape (a view of unit.full)")

        def _reduce(self, u):
            self._reduced.add(id(u))
            u.free()
            S.reduce_unit_grads(u, self.group)

        def _finish_reduction(self):
            pass

    def equal():
        ref_losses, ref_sd = reference_run(cfg, tokens)
        model = HandZeRO3(Local(gpt.GPT(cfg, seed=SEED)), world)
        losses = train_strategy(model, cfg, tokens)
        close(losses, ref_losses, "the loss per step")
        close_dicts(model.full_state_dict(), ref_sd, f"after {STEPS} steps the parameters")

    def freed_and_bytes():
        model = HandZeRO3(Local(gpt.GPT(cfg, seed=SEED)), world)
        seen = []
        for u, m in zip(model.units[1:], model.module.transformer.h):
            m.register_forward_hook(lambda mod, args, out, u=u: seen.append(u.materialized()))
        world.reset_stats()
        train_strategy(model, cfg, tokens, steps=1)
        need(seen and not any(seen), "a unit is still materialized after its forward: free it")
        held = [p for u in model.units for p in u.params if p.data.size]
        need(not held, f"{len(held)} parameters still hold full data after the step: free every unit")
        need(model.gathers == 2 * len(model.units),
             f"{model.gathers} gathers for {len(model.units)} units; each unit is gathered twice a step "
             f"(forward, then again for backward)")
        pad = sum(u.padded for u in model.units) * 8
        ag = world.stats.get("all_gather", {}).get("bytes", 0)
        rs = world.stats.get("reduce_scatter", {}).get("bytes", 0)
        need(ag == 2 * ring_bytes(pad, n) and rs == ring_bytes(pad, n),
             f"all-gather {ag} and reduce-scatter {rs} bytes; ZeRO-3 moves 2(n-1)/n*Psi*b and (n-1)/n*Psi*b "
             f"({2 * ring_bytes(pad, n)} and {ring_bytes(pad, n)}): 3 Psi in all")

    return [("equals single-process training", equal),
            ("frees after forward, gathers again for backward: 3(n-1)/n*Psi*b", freed_and_bytes)]


# ------------------------------------------------------------------ 06 Megatron column/row parallel
def checks_06(S, world):
    from pdist import functional as F
    from pdist.autograd import Tensor
    from pdist.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear
    from pdist.parallel.tp_regions import partition
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
    from pdist.autograd import Tensor
    from pdist.backend import xp
    from pdist.parallel.tp_layers import vocab_parallel_cross_entropy
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
    from pdist.parallel import schedules as sch

    def valid():
        for p in (1, 2, 3, 4):
            for m in (1, 2, p, 2 * p + 1):
                try:
                    sch.check_schedule(S.one_f_one_b(p, m), m)
                except (AssertionError, sch.DeadlockError) as e:
                    raise CheckFailed(f"p={p}, m={m}: the schedule checker says: {e}") from None

    def bubble():
        for p, m in ((2, 4), (4, 4), (4, 8), (3, 5)):
            spans = sch.simulate(S.one_f_one_b(p, m))
            got = max(sch.bubble_fraction(spans))
            want = sch.theoretical_bubble(p, m)
            need(abs(got - want) < 1e-12, f"p={p}, m={m}: simulated bubble {got:.4f}, theory (p-1)/(m+p-1) = {want:.4f}")

    def stash():
        for p, m in ((2, 4), (4, 8), (4, 2), (3, 5)):
            peaks = sch.check_schedule(S.one_f_one_b(p, m), m)
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
    from pdist import lesson, nn
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


CHECKS = {f"{i:02d}": globals()[f"checks_{i:02d}"] for i in range(1, 11)}


def main(exercise, source):
    from pdist import comm
    from pdist.backend import set_default_dtype
    from pdist.testing import report
    set_default_dtype("float64")
    world = comm.init()
    try:
        S = load(source)
        checks = CHECKS[exercise](S, world)
    except Exception as e:
        report(exercise=exercise, index=-1, check="loads", ok=False, rank=world.rank,
               msg=f"the exercise file does not load: {type(e).__name__}: {e}")
        _stop()
    for i, (name, fn) in enumerate(checks):
        t0 = time.perf_counter()
        try:
            fn()
        except NotImplementedError as e:
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank, kind="todo",
                   msg=f"not written yet ({e})")
            _stop()
        except CheckFailed as e:
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank, msg=str(e))
            _stop()
        except comm.CollectiveTimeoutError as e:
            head = str(e).splitlines()[0]
            where = head.split(" did not complete")[0] if e.reason == "timeout" else head
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank, kind="timeout",
                   reason=e.reason, where=where, msg=head)
            _stop()
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)
            at = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                       if "student_exercise" in f.filename or f.filename == os.path.abspath(source)), "")
            first = (str(e).splitlines() or [""])[0]
            report(exercise=exercise, index=i, check=name, ok=False, rank=world.rank,
                   msg=f"raised {type(e).__name__}: {first}" + (f" ({at})" if at else ""))
            _stop()
        report(exercise=exercise, index=i, check=name, ok=True, rank=world.rank,
               seconds=round(time.perf_counter() - t0, 3))
    report(exercise=exercise, done=True, rank=world.rank, checks=len(checks))


def _stop():
    """This rank has reported its failure: give the others a moment to report theirs
    (ranks in one deadlock time out together), then end the job without the exit hooks."""
    sys.stdout.flush()
    time.sleep(0.5)
    os._exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
