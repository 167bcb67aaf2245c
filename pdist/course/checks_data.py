"""Checks of exercises 01-05: the ring all-reduce, data parallelism by hand, bucketed DDP
(checks_ddp.py), ZeRO-1 and a ZeRO-3 unit (checks_zero.py; the grader runs them through pdist/course/checks.py)."""

import numpy as np

from pdist.course.checks_ddp import checks_03  # noqa: F401  (the grader finds every exercise here)
from pdist.course.checks_zero import checks_04, checks_05  # noqa: F401
from pdist.course.common import (SEED, batches, close, equal_to_one_process, need, one_process_grads,
                                ring_bytes, sub_groups, tiny_cfg, train_strategy)


def checks_01(S, world):
    from pdist.engine.backend import xp
    groups = sub_groups(world)                   # n = 2 and 3 (the rest: 2 and 1), then the world

    def values(size, q):
        return np.random.default_rng([size, q]).standard_normal(size)

    def run(g, size):
        buf = xp.asarray(values(size, g.rank))
        S.ring_all_reduce(g, buf)
        return buf, sum(values(size, q) for q in range(g.size))

    def small():
        for g in groups:
            n = g.size
            for size in (n * 4, 1, n - 1 or 1, 7 * n + 3, 2 * n + 1):
                got, want = run(g, size)
                close(got, want, f"n = {n}: the sum of a {size}-element buffer", rtol=1e-12)

    def big():
        got, want = run(world, 1 << 20)      # 8 MiB: each chunk is past MPI's eager limit
        close(got, want, "the sum of a 2^20-element buffer", rtol=1e-12)

    def bytes_sent():
        for g in groups:
            n = g.size
            g.reset_stats()
            size = 64 * n
            run(g, size)
            sent = g.stats.get("send", {}).get("bytes", 0)
            want = ring_bytes(size * 8, n, 2)
            need(sent == want, f"n = {n}: rank {g.rank} sent {sent} bytes for S = {size * 8}; a ring sends "
                               f"2(n-1)/n*S = {want}")
            others = [k for k in g.stats if k not in ("send", "recv")]
            need(not others, f"use only point-to-point calls (found {others})")

    return [("sums small and uneven buffers at n = 1, 2, 3, 4", small), ("sums an 8 MiB buffer (no deadlock)", big),
            ("sends 2(n-1)/n*S bytes at every n", bytes_sent)]


# ------------------------------------------------------------------ 02 data parallelism by hand
def _odd_grads(S, world):
    """average_gradients on a gradient that is None on rank 0 and on an F-ordered one."""
    from pdist.engine.autograd import Tensor
    from pdist.engine.backend import xp
    p, q = Tensor(xp.zeros(5), requires_grad=True), Tensor(xp.zeros((3, 4)), requires_grad=True)
    p.grad = None if world.rank == 0 else xp.ones(5)
    q.grad = xp.asfortranarray(np.arange(12.0).reshape(3, 4) * (world.rank + 1))     # like a tied weight's
    S.average_gradients([p], world)
    need(p.grad is not None, "a parameter whose gradient is None on this rank must still get the average "
                             "(contribute zeros), or the ranks run different collectives")
    close(p.grad, np.full(5, (world.size - 1) / world.size), "the average of an unused parameter's gradient "
          "(None on rank 0 = zeros)")
    S.average_gradients([q], world)
    close(q.grad, np.arange(12.0).reshape(3, 4) * (world.size + 1) / 2, "the average of an F-ordered gradient")


def checks_02(S, world):
    from pdist.models import gpt
    from pdist.parallel.base import Local
    from pdist.parallel.data_parallel import DataParallelNaive
    cfg, tokens = tiny_cfg()

    class HandLocal(Local):
        def compute(self, x, y, loss_scale=1.0):
            return S.accumulate_gradients(self.module, x, y, self.microbatches)

    class HandDP(DataParallelNaive):
        def finish_grad_sync(self):
            self.inner.finish_grad_sync()
            S.average_gradients(self._param_list, self.group)

    def gradient():
        want = one_process_grads(cfg, tokens, None, None)
        for g in sub_groups(world, (2,)):
            got = one_process_grads(cfg, tokens, g, S.average_gradients)
            for k in want:
                close(got[k], want[k], f"n = {g.size}: after average_gradients, {k}.grad (vs one process's "
                                       f"gradient of the whole batch)")

    def accumulated():
        want = one_process_grads(cfg, tokens, None, None)
        model = gpt.GPT(cfg, seed=SEED)
        x, y = batches(cfg, tokens)(0)
        loss = S.accumulate_gradients(model, x, y, 2)
        for k, p in model.named_parameters():
            close(p.grad, want[k], f"k = 2 micro-batches of the whole batch, one process: {k}.grad (vs the "
                                   f"whole batch's gradient)")
        close(loss, float(model(x, y)[1].item()), "k = 2: the returned loss (vs the whole batch's mean loss)")

    def equal(k):
        equal_to_one_process(HandDP(HandLocal(gpt.GPT(cfg, seed=SEED), microbatches=k), world), cfg, tokens)

    def bytes_sent():
        model = HandDP(Local(gpt.GPT(cfg, seed=SEED)), world)
        world.reset_stats()
        train_strategy(model, cfg, tokens, steps=1)
        got = world.bytes_sent()
        want = sum(ring_bytes(p.data.nbytes, world.size, 2) for p in model.parameters())
        need(got == want, f"one step sent {got} bytes; all-reducing every gradient once is 2(n-1)/n*Psi*b = {want}")

    return [("averages every gradient at n = 2 and 3 (the one-process gradient)", gradient),
            ("an unused parameter (grad None) contributes zeros; an F-ordered gradient works", lambda: _odd_grads(S, world)),
            ("equals single-process training", lambda: equal(1)), ("sends 2(n-1)/n*Psi*b per step", bytes_sent),
            ("gradient accumulation (k = 2) gives the whole batch's gradient and mean loss", accumulated),
            ("gradient accumulation (k = 2) equals single-process training", lambda: equal(2))]
