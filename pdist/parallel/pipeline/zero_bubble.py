"""Zero-bubble pipeline schedules as data: the backward split into B and W.

B (``BACKWARD_INPUT``) is dL/d(input) of a (micro-batch, chunk): the previous stage
waits for it. W (``BACKWARD_WEIGHT``) is the same micro-batch's weight gradients:
nobody waits for it, so it can be moved into the bubble (Qi, Wan, Huang and Lin,
"Zero Bubble Pipeline Parallelism", ICLR 2024). Each function returns one compute
order per rank, expanded into instructions by ``instructions._program`` (each receive
right before its compute, each send right after; W sends nothing).

* ``zb_h1(p, m)`` -- ZB-H1 (Qi et al., 2024, sec. 3.1): 1F1B's order of F and B
  (min(p-1-s, m) warm-up forwards on stage s), and stage s runs its W's s
  behind: after B_i comes W_{i-s}, the last s W's fill the cool-down. In flight
  (forwarded, W not yet run) at most p micro-batches on any stage: 1F1B's peak.
* ``zb_v(p, m)`` -- ZB-V (Qi et al., 2024, sec. 6): two chunks per rank in a V
  (placement "v": rank s holds stages s and 2p-1-s). Built by list scheduling
  at unit costs: a rank runs, of what is ready, a B (chunk 0 first), else a
  forward (chunk 1 first), else the oldest W, with at most 2p chunk-activations
  in flight (the memory of 1F1B's p whole-stage activations).
* ``dualpipev(p, m)`` -- DualPipeV (DeepSeek-AI, "DeepSeek-V3 Technical Report",
  2024, sec. 3.2.1, DualPipe cut in half to one V): eight phases per rank s
  (warm-up forwards of chunk 0; F0 F1 pairs; B1 W1 F1; the main F0 B1 F1 B0
  steps, whose forward and backward DeepSeek overlaps -- run one after the other
  here; B1 F1 B0; B1 B0 with the later half split into B and W; W B0; the last
  W's). Its backwards before the split are whole BACKWARDs. DeepSeek defines it
  for m >= 2p; for m < 2p the phases run what is left (valid, larger bubble).

Planned bubble (``simulate`` with t_F = t_B = t_W = 1 per (micro-batch, chunk),
communication free; fraction = idle / makespan, the makespan from the first
forward to the last compute on any rank):

    1F1B       (p-1)(t_F+t_B+t_W) idle per stage  -> (p-1)/(m+p-1)          (Narayanan et al., 2021)
    ZB-H1      (p-1)(t_F+t_B-t_W) idle per stage  -> (p-1)/(3m+p-1),  m >= p (Qi et al., 2024, sec. 3.1)
    ZB-V       (p-1) t_F idle per rank            -> (p-1)/(6m+p-1),  m >= p, p <= 4 (*)
    DualPipeV  (p-1) t_F idle per rank            -> (p-1)/(6m+p-1),  m >= 2p

ZB-V and DualPipeV reach the lower bound of any schedule of 2 chunks per rank:
rank p-1 cannot start before the first micro-batch crossed p-1 chunks, (p-1) t_F,
and then works 6m t_F; the paper's "zero bubble" counts from each rank's own
first compute (and lets the next step start early), where this idle is gone.
In t_F of a whole stage (a chunk is half of one) that is (p-1)/2 -- half of
ZB-H1's and a sixth of 1F1B's idle. ``theoretical_bubble`` (simulate.py) gives
these; the tests check the simulated schedules against them exactly.
(*) The list scheduling reaches the bound for every m >= p up to p = 4; at p = 5..8
it ends 1-2 t_F later at some m (a rule that always reaches it needs more than 2p
chunk-activations in flight on the later ranks).
"""
from pdist.parallel.pipeline.instructions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, _check_args,
                                                  _program, virtual_stage)

F, B, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT


def zb_h1_order(p, m, s):
    """Stage s's compute order of ZB-H1: 1F1B's F/B order, W_{i-s} right after B_i."""
    warm = min(p - s - 1, m)
    fb = [(F, i, 0) for i in range(warm)]
    for i in range(m - warm):
        fb += [(F, warm + i, 0), (B, i, 0)]
    fb += [(B, i, 0) for i in range(m - warm, m)]
    order, w = [], 0
    for op in fb:
        order.append(op)
        if op[0] == B and op[1] >= s:             # stage s keeps s W's back for the cool-down
            order.append((W, w, 0))
            w += 1
    return order + [(W, i, 0) for i in range(w, m)]


def zb_h1(p, m):
    """ZB-H1 (Qi et al., 2024): 1F1B's memory, about a third of its bubble."""
    _check_args(p, m)
    return [_program(p, s, 1, zb_h1_order(p, m, s)) for s in range(p)]


def _ready(s, c, op, mb, p, m, t, done):
    """Can rank s start ``op`` of micro-batch mb on chunk c at time t (placement "v")?"""
    k = virtual_stage(c, p, s, "v")
    if mb >= m:
        return False
    if op == F:
        return k == 0 or done.get((F, mb, k - 1), t + 1) <= t
    return done.get((F, mb, k), t + 1) <= t and (k == 2 * p - 1 or done.get((B, mb, k + 1), t + 1) <= t)


def zb_v_orders(p, m):
    """ZB-V's compute orders by list scheduling at unit costs (the module's docstring): ready B
    (chunk 0 first), else ready F (chunk 1 first, at most 2p chunk-activations in flight),
    else the oldest W. Each op starts only once its inputs exist, so the orders replay
    without deadlock."""
    done, orders = {}, [[] for _ in range(p)]
    nxt = [{(op, c): 0 for op in (F, B) for c in (0, 1)} for _ in range(p)]
    waiting, live = [[] for _ in range(p)], [0] * p
    for t in range(12 * m * p + 12):               # each step some rank runs (a bound, not a guess)
        if all(len(o) == 6 * m for o in orders):
            return orders
        for s in range(p):
            pick = next(((op, nxt[s][op, c], c) for op, c in ((B, 0), (B, 1), (F, 1), (F, 0))
                         if (op == B or live[s] < 2 * p) and _ready(s, c, op, nxt[s][op, c], p, m, t, done)),
                        None)
            if pick is None and waiting[s]:
                pick = (W,) + waiting[s].pop(0)
            if pick is None:
                continue
            op, mb, c = pick
            if op != W:
                nxt[s][op, c] += 1
            live[s] += {F: 1, B: 0, W: -1}[op]
            if op == B:
                waiting[s].append((mb, c))
            done[(op, mb, virtual_stage(c, p, s, "v"))] = t + 1
            orders[s].append(pick)
    raise RuntimeError(f"zb-v list scheduling did not finish for p={p}, m={m}")  # not reached


def zb_v(p, m):
    """ZB-V (Qi et al., 2024): two chunks per rank in a V, near-zero bubble at 1F1B's memory."""
    _check_args(p, m)
    return [_program(p, s, 2, order, "v") for s, order in enumerate(zb_v_orders(p, m))]


class _Ops:
    """One rank's queues for DualPipeV: the next micro-batch of each (pass, chunk) and the
    W's waiting for their turn; each call appends to ``order`` (nothing once a queue is empty)."""

    def __init__(self, m):
        self.next, self.m, self.waiting, self.order = {}, m, [], []

    def run(self, op, c, split=False):
        mb = self.next.get((op, c), 0)
        if mb >= self.m:
            return
        self.next[(op, c)] = mb + 1
        if op == F:
            self.order.append((F, mb, c))
        elif split:
            self.order.append((B, mb, c))
            self.waiting.append((mb, c))
        else:
            self.order.append((BACKWARD, mb, c))

    def exhausted(self):
        return all(self.next.get(key, 0) >= self.m for key in ((F, 0), (F, 1), (B, 0), (B, 1)))

    def weight(self):
        if self.waiting:
            self.order.append((W,) + self.waiting.pop(0))


def dualpipev_order(p, m, s):
    """Rank s's compute order of DualPipeV (the eight phases of the module's docstring)."""
    q = _Ops(m)
    for _ in range(2 * (p - s - 1)):              # 1: warm-up forwards of chunk 0
        q.run(F, 0)
    for _ in range(s + 1):                         # 2: F0 F1
        q.run(F, 0), q.run(F, 1)
    for _ in range(p - s - 1):                     # 3: B1 W1 F1 (split)
        q.run(B, 1, split=True), q.weight(), q.run(F, 1)
    for _ in range(max(0, m - 2 * p + s + 1)):     # 4: the main phase, F0 B1 F1 B0
        q.run(F, 0), q.run(B, 1), q.run(F, 1), q.run(B, 0)
    for _ in range(p - s - 1):                     # 5: B1 F1 B0
        q.run(B, 1), q.run(F, 1), q.run(B, 0)
    split = False
    for i in range(s + 1):                         # 6: B1 B0, the later half split
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        q.run(B, 1, split)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        q.run(B, 0, split)
    for _ in range(p - s - 1):                     # 7: W B0
        q.weight(), q.run(B, 0, split=True)
    while q.waiting or not q.exhausted():          # 8: the W's (m < 2p: and what is left)
        for op, c in ((F, 0), (F, 1), (B, 1), (B, 0)):
            q.run(op, c, split=True)
        q.weight()
    return q.order


def dualpipev(p, m):
    """DualPipeV (DeepSeek-AI, 2024): DualPipe's F/B/W phases on one V of two chunks per rank."""
    _check_args(p, m)
    return [_program(p, s, 2, dualpipev_order(p, m, s), "v") for s in range(p)]


__all__ = ["zb_h1", "zb_h1_order", "zb_v", "zb_v_orders", "dualpipev", "dualpipev_order"]
