"""Reference answers of the course exercises (lessons/exercises/), for the grader.

``python -m pdist.grade --reference`` runs every check against these; the student
files never import them, and the grader never prints them. Each function has the
name and signature of its exercise file; the math is in that file's docstring.
"""
from pdist.engine.autograd import Function
from pdist.engine.backend import xp
from pdist.comm.algorithms import chunk_bounds


# ------------------------------------------------ 01: ring all-reduce (Patarasuk & Yuan 2009)
def ring_all_reduce(group, buf):
    """buf <- sum_r buf_r: n-1 reduce-scatter steps, then n-1 all-gather steps."""
    n, r = group.size, group.rank
    if n == 1:
        return
    bounds = chunk_bounds(buf.size, n)
    tmp = xp.empty(max(b - a for a, b in bounds), dtype=buf.dtype)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                       # reduce-scatter: rank r ends owning chunk r
        sa, sb = bounds[(r - s - 1) % n]
        ra, rb = bounds[(r - s - 2) % n]
        group.sendrecv(buf[sa:sb], right, tmp[:rb - ra], left)
        buf[ra:rb] += tmp[:rb - ra]
    for s in range(n - 1):                       # all-gather: pass the finished chunks on
        sa, sb = bounds[(r - s) % n]
        ra, rb = bounds[(r - s - 1) % n]
        group.sendrecv(buf[sa:sb], right, buf[ra:rb], left)


# ------------------------------------------------ 02: data parallelism by hand (Li et al. 2020)
def average_gradients(params, group):
    for p in params:
        if p.grad is None:
            p.grad = xp.zeros_like(p.data)
        elif not p.grad.flags.c_contiguous:
            p.grad = xp.ascontiguousarray(p.grad)
        group.all_reduce(p.grad, op="avg")


def accumulate_gradients(module, x, y, k):
    b, total = len(x) // k, 0.0
    for i in range(k):
        _, loss = module(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
        (loss * (1.0 / k)).backward()
        total += loss.item() / k
    return total


# ------------------------------------------------ 03: bucketed DDP (Li et al. 2020, sec. 3.2)
def make_buckets(params, cap_bytes):
    groups, cur, size = [], [], 0
    for p in reversed(params):                  # backward's order: the last parameters first
        if cur and size + p.data.nbytes > cap_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.data.nbytes
    return groups + ([cur] if cur else [])


def on_grad_ready(ddp, p):
    b = ddp.bucket_of[id(p)]
    b.ready.add(id(p))
    while ddp.next < len(ddp.buckets) and len(ddp.buckets[ddp.next].ready) == len(ddp.buckets[ddp.next].params):
        nb = ddp.buckets[ddp.next]
        nb.work = ddp.group.all_reduce(nb.buffer, op="avg", async_op=True)
        ddp.next += 1


def finish_grad_sync(ddp):
    for b in ddp.buckets[ddp.next:]:
        b.work = ddp.group.all_reduce(b.buffer, op="avg", async_op=True)
    for b in ddp.buckets:
        b.work.wait()
        b.work = None
        b.ready.clear()
    ddp.next = 0


# ------------------------------------------------ 04: ZeRO-1 (Rajbhandari et al. 2020, sec. 5.1)
def zero1_step(flat_params, flat_grads, shard, optimizer, group):
    a, b = chunk_bounds(flat_params.size, group.size)[group.rank]
    g = xp.empty(b - a, dtype=flat_grads.dtype)
    group.reduce_scatter(g, flat_grads, op="avg")
    shard.grad = g
    optimizer.step()
    group.all_gather(flat_params, shard.data)


# ------------------------------------------------ 05: ZeRO-3, one unit (Rajbhandari et al. 2020, sec. 5.3)
def gather_unit(unit, group):
    flat = xp.empty(unit.padded, dtype=unit.dtype)
    group.all_gather(flat, unit.shard.data)
    for p, o, s in zip(unit.params, unit.offsets, unit.shapes):
        p.data = flat[o:o + _numel(s)].reshape(s)
    unit.full = flat


def free_unit(unit):
    for p in unit.params:
        p.data = xp.empty((0,), dtype=unit.dtype)
    unit.full = None


def reduce_unit_grads(unit, group):
    g = xp.empty(unit.hi - unit.lo, dtype=unit.dtype)
    group.reduce_scatter(g, unit.grad_flat, op="avg")
    unit.shard.grad = g
    unit.grad_flat = None
    for p in unit.params:
        p.grad = None


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------ 06: Megatron f and g (Shoeybi et al. 2019, sec. 3)
class CopyToTP(Function):
    def forward(self, x, group):
        self.group = group
        return x

    def backward(self, g):
        out = xp.array(g, copy=True, order="C")
        self.group.all_reduce(out)
        return out


class ReduceFromTP(Function):
    def forward(self, x, group):
        out = xp.array(x, copy=True, order="C")
        group.all_reduce(out)
        return out

    def backward(self, g):
        return g


def column_parallel_forward(layer, x):
    from pdist.engine import functional as F
    return F.linear(CopyToTP.apply(x, layer.group), layer.weight, layer.bias)


def row_parallel_forward(layer, x):
    from pdist.engine import functional as F
    y = ReduceFromTP.apply(F.linear(x, layer.weight), layer.group)
    return y + layer.bias if layer.bias is not None else y


# ------------------------------------------------ 07: vocab-parallel cross-entropy (Shoeybi et al. 2019, sec. 3)
def vocab_parallel_ce_forward(logits, targets, vocab_start, group):
    n, v = logits.shape
    m = logits.max(axis=1)
    group.all_reduce(m, op="max")
    e = xp.exp(logits - m[:, None])
    s = e.sum(axis=1)
    group.all_reduce(s)
    local = targets - vocab_start
    mine = (local >= 0) & (local < v)
    zt = xp.zeros(n, dtype=logits.dtype)
    rows = xp.arange(n)
    zt[mine] = logits[rows[mine], local[mine]] - m[mine]
    group.all_reduce(zt)
    return xp.log(s) - zt, e / s[:, None]


def vocab_parallel_ce_backward(probs, targets, vocab_start, grad_rows):
    n, v = probs.shape
    d = probs.copy()
    local = targets - vocab_start
    mine = (local >= 0) & (local < v)
    rows = xp.arange(n)
    d[rows[mine], local[mine]] -= 1.0
    return d * grad_rows[:, None]


# ------------------------------------------------ 08: 1F1B as data (Narayanan et al. 2021, sec. 2.1)
def one_f_one_b(p, m):
    from pdist.parallel.pipeline.schedules import BACKWARD, FORWARD, _program
    programs = []
    for s in range(p):
        w = min(p - s - 1, m)                   # warm-up forwards
        order = [(FORWARD, i, 0) for i in range(w)]
        for i in range(m - w):                  # steady state: one forward, one backward
            order += [(FORWARD, w + i, 0), (BACKWARD, i, 0)]
        order += [(BACKWARD, i, 0) for i in range(m - w, m)]    # drain
        programs.append(_program(p, s, 1, order))
    return programs


# ------------------------------------------------ 09: resharding reads (docs/checkpoint.md)
def plan_reads(saved, offsets, shape):
    plan = []
    for i, s in enumerate(saved):
        lo = [max(o, a) for o, a in zip(offsets, s["offsets"])]
        hi = [min(o + n, a + k) for o, n, a, k in zip(offsets, shape, s["offsets"], s["shape"])]
        if all(a < b for a, b in zip(lo, hi)):
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s["offsets"]))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            plan.append((i, src, dst))
    return plan


# ------------------------------------------------ 10: find the hang (docs/failures.md)
def fixed_train(model, opt, group, get_batch, steps):
    import numpy as np
    from pdist import comm, nn
    from pdist.data import shard
    losses = []
    for step in range(steps):
        comm.set_step(step)
        x, y = shard(get_batch(step), group.rank, group.size)
        loss = nn.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            group.all_reduce(p.grad, op="avg")
        opt.step()
        opt.zero_grad()
        v = np.array([loss.item()])
        group.all_reduce(v, op="avg")
        losses.append(float(v[0]))
    return losses


# ------------------------------------------------ 13: ZB-H1 as data (Qi et al. 2024, sec. 3.1)
def zb_h1(p, m):
    from pdist.parallel.pipeline.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, _program
    programs = []
    for s in range(p):
        w = min(p - s - 1, m)                   # 1F1B's warm-up forwards
        fb = [(FORWARD, i, 0) for i in range(w)]
        for i in range(m - w):
            fb += [(FORWARD, w + i, 0), (BACKWARD_INPUT, i, 0)]
        fb += [(BACKWARD_INPUT, i, 0) for i in range(m - w, m)]
        order, done = [], 0
        for op in fb:                           # stage s keeps s W's back for its cool-down
            order.append(op)
            if op[0] == BACKWARD_INPUT and op[1] >= s:
                order.append((BACKWARD_WEIGHT, done, 0))
                done += 1
        order += [(BACKWARD_WEIGHT, i, 0) for i in range(done, m)]
        programs.append(_program(p, s, 1, order))
    return programs


# ------------------------------------------------ 11: online-softmax merge (Milakov & Gimelshein 2018; Dao et al. 2022)
def merge_block(m, l, o, s, v, diagonal):
    from pdist.engine.backend import xp
    from pdist.engine.functional import causal_mask
    if diagonal:
        s = s + causal_mask(s.shape[-2], s.shape[-1], s.dtype)
    m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
    alpha, p = xp.exp(m - m_new), xp.exp(s - m_new)         # the old sums rescaled to the new max
    return m_new, alpha * l + p.sum(axis=-1, keepdims=True), alpha * o + p @ v


def finish(m, l, o):
    from pdist.engine.backend import xp
    return o / l, m + xp.log(l)


# 12: MoE dispatch and combine, in its own file (this one is near its line budget)
from pdist.course.solutions_moe import (AllToAllV, combine, dispatch, moe_forward,  # noqa: E402,F401
                                        reduce_gradients, sort_by_expert)
