"""ZeRO-3's parameters (P_os+g+p; FSDP's "full shard"): each unit gathered around its forward
and again around its backward, freed after each (Rajbhandari et al., 2020, sec. 5.3).

    forward of unit u:   all-gather(shard_u) -> W_u;  y = f_u(x);  free W_u
    backward of unit u:  all-gather(shard_u) -> W_u;  dx, dW_u = ...;  reduce-scatter(dW_u) (zero.py); free W_u

A forward pre-hook gathers the unit (waiting for its prefetch if one is in flight) and starts
the all-gather of the unit after it (``prefetch``: the next unit of the forward order, or of
the backward order, which is the forward's reversed); a forward hook frees it and puts a hook
on its output, which fires before the unit's backward runs and gathers it again. The root
unit (the parameters in no unit) is hooked on the model itself. Mixed into ``ZeRO`` (zero.py):
it reads ``units``, ``root``, ``prefetch`` and ``module``.
"""
from pdist.engine import hooks
from pdist.engine.autograd import is_grad_enabled


class GatherParams:
    """ZeRO-3's gathers (module docstring)."""

    def _install_gathers(self, unit_modules, experts=()):
        # forward order: root, then the units in the order given; backward: root, then reversed
        body = self.units[1:] if self.root else self.units
        dense = body[:len(body) - len(experts)]       # experts' units: gathered when their layer runs
        self._fwd_order = ([self.root] if self.root else []) + dense
        self._bwd_order = ([self.root] if self.root else []) + dense[::-1]
        hooked = ([(self.module, self.root)] if self.root else []) + list(zip(list(unit_modules) + list(experts), body))
        for m, u in hooked:
            m.register_forward_pre_hook(lambda mod, args, u=u: self._before_forward(u))
            m.register_forward_hook(lambda mod, args, out, u=u: self._after_forward(u, out))

    def _start_gather(self, u):
        if u.materialized() or u.gather_work is not None:
            return
        buf = u.gather_buffer()                                           # (Ψ_pad,)
        u.gather_work = (buf, u.group.all_gather(buf, u.shard.data, async_op=True))

    def _gather(self, u, order):
        """Materialize u (waiting for its prefetch if one is in flight), then
        start the all-gather of the unit after u in ``order``."""
        if not u.materialized():
            self._start_gather(u)
            buf, work = u.gather_work
            work.wait()
            u.gather_work = None
            u.finish_gather(buf)
            hooks.event("all-gather", u.name)
        if self.prefetch and u in order:
            i = order.index(u)
            if i + 1 < len(order):
                self._start_gather(order[i + 1])

    def _before_forward(self, u):
        self._gather(u, self._fwd_order)

    def _after_forward(self, u, out):
        outs = out if isinstance(out, tuple) else (out,)
        if is_grad_enabled():
            for t in outs:
                if getattr(t, "requires_grad", False):
                    t.register_hook(lambda g, u=u: self._before_backward(u))
        u.free()

    def _before_backward(self, u):
        self._gather(u, self._bwd_order)


__all__ = ["GatherParams"]
