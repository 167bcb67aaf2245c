"""Checks of exercises 04 (ZeRO-1) and 05 (a ZeRO-3 unit), run through pdist/course/checks.py:
equality with single-process training on a model whose Psi does not divide by 3 (uneven
chunks, padded units), the shard's averaged gradient, bytes, memory, frees and views."""
import numpy as np

from pdist.course.common import (SEED, STEPS, batches, close, close_dicts, equal_to_one_process, need,
                                 one_process_grads, reference_run, ring_bytes, tiny_cfg, train_strategy)


def _flat_grad(want, names):
    """The one-process gradients {name: g} of ``names``, concatenated flat."""
    return np.concatenate([want[k].reshape(-1) for k in names])


# ------------------------------------------------------------------ 04 ZeRO-1
def _zero1_run(S, world, cfg, tokens, first):
    """STEPS steps of the tiny GPT with the student's zero1_step over flat buffers (each
    parameter a view); ``first`` gets step 0's shard.grad. Returns (model, psi, shard, opt)."""
    from pdist.models import gpt
    from pdist.course import lesson
    from pdist.engine.autograd import Tensor
    from pdist.engine.backend import xp
    from pdist.comm.algorithms import chunk_bounds
    from pdist.data import shard
    n, r = world.size, world.rank
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
        if step == 0:
            first.update(grad=None if sh.grad is None else np.array(sh.grad), bounds=(a, b),
                         names=[k for k, _ in model.named_parameters()])
    return model, psi, sh, opt


def checks_04(S, world):
    cfg, tokens = tiny_cfg(block_size=9)          # Psi = 4816: chunks differ by one element at n = 3
    n = world.size
    first = {}

    def run():
        return _zero1_run(S, world, cfg, tokens, first)

    def gradient():
        run()
        a, b = first["bounds"]
        need(first["grad"] is not None, "after zero1_step, shard.grad must hold this rank's chunk of the average")
        want = _flat_grad(one_process_grads(cfg, tokens, None, None), first["names"])[a:b]
        close(first["grad"], want, f"step 0: shard.grad (this rank's chunk [{a}, {b}) of the averaged gradient, vs "
                                   f"one process's gradient of the whole batch)")

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

    return [("the shard's gradient is this rank's chunk of the average (uneven chunks)", gradient),
            ("equals single-process training", equal),
            ("reduce-scatter + all-gather: 2(n-1)/n*Psi*b; Adam state only for the shard", bytes_and_memory)]


# ------------------------------------------------------------------ 05 ZeRO-3, one unit
def _hand_zero3(S):
    """pdist's ZeRO stage 3 (no prefetch) whose gather, free and reduce are the student's,
    each followed by the check of its contract; ``grads`` keeps each unit's reduced shard."""
    from pdist.parallel.zero import ZeRO

    class HandZeRO3(ZeRO):
        def __init__(self, module, group):
            self.names = {id(p): k for k, p in module.named_parameters()}
            super().__init__(module, 3, group, prefetch=False)
            for u in self.units:
                u.free = (lambda u=u: self._free(u))
            self.gathers, self.grads = 0, {}

        def _gather(self, u, order):
            if not u.materialized():
                S.gather_unit(u, self.group)
                self.gathers += 1
                need(u.materialized() and all(p.data.shape == s for p, s in zip(u.params, u.shapes)),
                     "after gather_unit every parameter must have its full shape (a view of unit.full)")
                need(all(np.shares_memory(p.data, u.full) for p in u.params),
                     "after gather_unit every parameter must be a view of unit.full, not a copy")

        @staticmethod
        def _free(u):
            S.free_unit(u)
            need(u.full is None and all(p.data.size == 0 for p in u.params),
                 "after free_unit every parameter must be empty (xp.empty((0,))) and unit.full None: "
                 "only the shard stays")

        def _reduce(self, u):
            self._reduced.add(id(u))
            u.free()
            S.reduce_unit_grads(u, self.group)
            need(u.shard.grad is not None, "after reduce_unit_grads, unit.shard.grad must hold this rank's shard")
            self.grads[id(u)] = np.array(u.shard.grad)
            need(u.grad_flat is None and all(p.grad is None for p in u.params),
                 "after reduce_unit_grads drop the full gradient (unit.grad_flat = None and every p.grad = None): "
                 "only the shard's gradient stays")

    return HandZeRO3


def checks_05(S, world):
    from pdist.models import gpt
    from pdist.parallel.base import Local
    cfg, tokens = tiny_cfg(block_size=9)          # the root unit's Psi does not divide by 3: padded
    n = world.size

    HandZeRO3 = _hand_zero3(S)

    def gradient():
        want = one_process_grads(cfg, tokens, None, None)
        model = HandZeRO3(Local(gpt.GPT(cfg, seed=SEED)), world)
        model.forward_backward(*model.local_batch(*batches(cfg, tokens)(0)))
        for u in model.units:
            flat = np.zeros(u.padded)
            for p, o, s in zip(u.params, u.offsets, u.shapes):
                flat[o:o + int(np.prod(s))] = want[model.names[id(p)]].reshape(-1)
            need(id(u) in model.grads, "a unit's gradient was never reduced")
            close(model.grads[id(u)], flat[u.lo:u.hi], f"unit {u.name}: shard.grad (this rank's [{u.lo}, {u.hi}) "
                                                      f"of the averaged gradient, padded to {u.padded})")

        def _finish_reduction(self):
            pass

    def equal():
        equal_to_one_process(HandZeRO3(Local(gpt.GPT(cfg, seed=SEED)), world), cfg, tokens)

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

    return [("the shard's gradient is the average (padded units)", gradient),
            ("equals single-process training", equal),
            ("frees after forward, gathers again for backward: 3(n-1)/n*Psi*b", freed_and_bytes)]


# ------------------------------------------------------------------ 06 Megatron column/row parallel
