"""Checks of exercise 03, bucketed DDP (run through pdist/course/checks.py): the buckets
(cap boundaries included), the averaged gradient, issue order, ``ddp.next``, the waits,
overlap and bytes, against pdist's ``build_buckets`` and single-process training."""
from types import SimpleNamespace

from pdist.course.common import (SEED, CheckFailed, batches, close, equal_to_one_process, need, one_process_grads,
                                ring_bytes, sub_groups, tiny_cfg, train_strategy)


class _Recorder:
    """The group, with every all-reduce's buffer recorded (to see which bucket went when)."""

    def __init__(self, group):
        self._group, self.calls = group, []

    def __getattr__(self, name):
        return getattr(self._group, name)

    def all_reduce(self, buf, *args, **kw):
        self.calls.append(id(buf))
        return self._group.all_reduce(buf, *args, **kw)


def _finished(ddp):
    """After the student's finish_grad_sync: every Work waited on, every bucket reset."""
    from pdist.comm.failures import unwaited
    left = unwaited()
    if left:
        raise CheckFailed(f"finish_grad_sync returned with {len(left)} all-reduce(s) whose Work was never "
                          f"waited on: call .wait() on every bucket's Work before it returns (until then a "
                          f"buffer holds neither the sum nor the average)", detail="\n".join(left))
    need(all(b.work is None and not b.ready for b in ddp.buckets) and ddp.next == 0,
         "after finish_grad_sync every bucket must be reset for the next step "
         "(b.work = None, b.ready cleared, ddp.next = 0)")


def _hand_ddp(S, cap):
    """DDP whose bucketing, gradient hook and finish are the student's (S.make_buckets,
    S.on_grad_ready, S.finish_grad_sync); buckets of ``cap`` bytes, each a flat buffer
    whose views are the parameters' .grad. Records the buckets issued during backward."""
    from pdist.engine.backend import xp
    from pdist.parallel.data_parallel import _DataParallelBase

    class HandDDP(_DataParallelBase):
        def __init__(self, module, group):
            super().__init__(module, group)
            self.group = _Recorder(self.group)
            groups = S.make_buckets(self._param_list, cap)
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
            self.index_of = {id(b.buffer): b.index for b in self.buckets}
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
            before, calls = self.next, len(self.group.calls)
            S.on_grad_ready(self, p)
            new = [self.index_of.get(c, "?") for c in self.group.calls[calls:]]
            if new and self.next == before:
                raise CheckFailed(f"on_grad_ready issued bucket(s) {new} but left ddp.next at {before}: "
                                  f"advance ddp.next past every bucket you issue (it is the next one to issue)")
            self.issued_in_backward += self.next - before

        def finish_grad_sync(self):
            self.inner.finish_grad_sync()
            for p in self._param_list:
                self._view(p)
            S.finish_grad_sync(self)
            _finished(self)

        def zero_grad(self):
            self.inner.zero_grad()
            for b in self.buckets:
                b.buffer[...] = 0
            for p in self._param_list:
                self._view(p)

    return HandDDP


def _buckets(S, cfg, cap0):
    """make_buckets against pdist's build_buckets at several caps: caps met exactly by the last
    1, 2, 3 parameters, one smaller than every parameter, one smaller than the biggest."""
    from pdist.models import gpt
    from pdist.parallel.data_parallel import build_buckets
    params = [p for _, p in gpt.GPT(cfg, seed=SEED).named_parameters()]
    back = [p.data.nbytes for p in reversed(params)]
    exact = [sum(back[:j]) for j in (1, 2, 3)]          # a bucket that fills its cap exactly
    for cap in [cap0] + exact + [min(back) - 1, max(back) // 2]:
        got = S.make_buckets(params, cap)
        flat = [id(p) for b in got for p in b]
        need(sorted(flat) == sorted(id(p) for p in params) and len(flat) == len(params),
             f"cap {cap} bytes: every parameter must be in exactly one bucket")
        want = build_buckets(params, cap, cap)
        sizes = [sum(p.data.nbytes for p in b) for b in got]
        need([[id(p) for p in b] for b in got] == [[id(p) for p in b] for b in want],
             f"cap {cap} bytes: buckets differ from DDP's ({len(got)} vs {len(want)} buckets, yours of "
             f"{sizes[:4]}... bytes): walk the parameters in backward's order; close a bucket only when the "
             f"next parameter would pass the cap (exactly the cap is allowed); a bigger one gets its own")


def checks_03(S, world):
    from pdist.models import gpt
    from pdist.parallel.base import Local
    cfg, tokens = tiny_cfg()
    CAP = 8 * 1024
    HandDDP = _hand_ddp(S, CAP)

    def gradient():
        want = one_process_grads(cfg, tokens, None, None)
        for g in sub_groups(world, (2,)):
            model = HandDDP(Local(gpt.GPT(cfg, seed=SEED)), g)
            model.forward_backward(*model.local_batch(*batches(cfg, tokens)(0)))
            for k, p in model.named_parameters():
                close(p.grad, want[k], f"n = {g.size}: after finish_grad_sync, {k}.grad (vs one process's gradient "
                                       f"of the whole batch)")

    def in_order():
        model = HandDDP(Local(gpt.GPT(cfg, seed=SEED)), world)
        model.forward_backward(*model.local_batch(*batches(cfg, tokens)(0)))
        order = [model.index_of.get(c) for c in model.group.calls if c in model.index_of]
        need(order == list(range(len(model.buckets))),
             f"buckets were all-reduced in the order {order}: issue bucket i only after bucket i-1, each once "
             f"(every rank must run the same all-reduces in the same order)")

    def equal():
        equal_to_one_process(HandDDP(Local(gpt.GPT(cfg, seed=SEED)), world), cfg, tokens)

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

    return [("buckets are DDP's (caps met exactly, a parameter bigger than the cap)", lambda: _buckets(S, cfg, CAP)),
            ("averages every gradient at n = 2 and 3 (the one-process gradient)", gradient),
            ("issues the buckets in order, each once", in_order),
            ("equals single-process training", equal),
            ("overlaps backward; one all-reduce per bucket", overlap_and_bytes)]
