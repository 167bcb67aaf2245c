"""FlatParamUnit: one unit's parameters as a single flat, padded, sharded buffer.

    flat    = concat(p_1.reshape(-1), ..., p_k.reshape(-1), zeros(pad))   # (Ψ_pad,)
    Ψ_pad   = ceil(Ψ_u / N) * N             (pad so that the N shards are equal)
    shard_r = flat[r Ψ_pad/N : (r+1) Ψ_pad/N]                            # (Ψ_pad/N,)

This is the storage layout of ZeRO (Rajbhandari et al., 2020) as PyTorch's FSDP
builds it (its ``FlatParameter``): a unit (a transformer block, the embeddings,
...) is flattened once, each rank owns one contiguous shard, and while the unit
is *materialized* its parameters are views into the gathered flat buffer:

    p_i.data = flat[off_i : off_i + size_i].reshape(shape_i)

so one all-gather into ``flat`` refreshes every parameter of the unit, and the
gradients, as views into a flat gradient buffer, are reduced with one
reduce-scatter. Freeing the unit sets every ``p_i.data`` to an empty
placeholder; the autograd engine reads parameters through ``p.data`` at
backward time (pdist.engine.autograd), so the unit can be gathered again before its
backward.

This file only holds storage and views; the collectives and the schedule (when
to gather, reduce, free) live in ``zero.py``. With ``sharded=False`` (stage 0)
there is no padding and the "shard" is the whole buffer.
"""
import weakref

from pdist.engine import hooks
from pdist.engine.autograd import Tensor
from pdist.engine.backend import xp
from pdist.engine.host_memory import mapped_empty
from pdist.engine.meta import is_meta


class FlatParamUnit:
    """The flat buffers of one unit of parameters on one rank of ``group``. ``op``/``scale``:
    how ZeRO reduces its gradient over ``group`` (then times ``scale``); ``deferred``: only
    in finish_grad_sync, in unit order (MoE experts: units.py)."""

    op, scale, deferred, used = "avg", None, False, False   # used: some gradient this step (units.py)

    def __init__(self, name, named_params, group, sharded, keep_full):
        if not named_params:
            raise ValueError(f"ZeRO unit {name!r} has no parameters")
        if len({is_meta(p.data) for _, p in named_params}) != 1:
            raise ValueError(f"ZeRO unit {name!r} mixes meta and materialized parameters")
        dtypes = {str(p.dtype) for _, p in named_params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO unit {name!r} mixes dtypes {sorted(dtypes)}: one flat buffer needs "
                             f"one dtype; cast the model (GPTConfig(dtype=...)) or split the unit")
        self.name, self.group = name, group
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [p.shape for p in self.params]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.size
        self.numel = off                                           # Ψ_u
        n, r = group.size, group.rank
        self.padded = -(-off // n) * n if sharded else off         # Ψ_pad
        self.lo, self.hi = (r * self.padded // n, (r + 1) * self.padded // n) if sharded else (0, off)
        self.dtype = self.params[0].dtype

        # meta parameters (pdist.engine.meta): zeros here, filled by ZeRO from the pieces; stage 3
        # then never allocates the full buffer
        self.meta = all(is_meta(p.data) for p in self.params)
        self.full = None            # the gathered flat buffer while materialized
        self._stale = None          # weakref to a freed buffer that autograd views may still pin
        self.gather_work = None     # (buffer, Work) of an all-gather in flight
        self.pool = None            # a host_memory.BufferPool (ZeRO sets it): freed buffers reused
        if self.meta and not keep_full:
            shard = xp.zeros(self.hi - self.lo, dtype=self.dtype)  # (Ψ_pad/N,)
            self.free()
        else:
            flat = xp.zeros(self.padded, dtype=self.dtype)         # (Ψ_pad,)
            for p, o in zip(self.params, self.offsets):
                if not self.meta:
                    flat[o:o + p.size] = p.data.reshape(-1)
            if keep_full:           # stages 0-2: params stay whole; the shard is a view
                self._attach(flat)
                shard = flat[self.lo:self.hi]                      # (Ψ_pad/N,) view
            else:                   # stage 3: only the shard persists
                shard = flat[self.lo:self.hi].copy()               # (Ψ_pad/N,)
                self.free()
        self.shard = Tensor(shard, requires_grad=True, name=f"{name}.flat_shard")
        self.grad_flat = None       # (Ψ_pad,) flat gradient while it is being filled
        self.ready = 0              # parameters of this unit whose grad is complete

    # ------------------------------------------------------------ parameters
    def _attach(self, flat):
        self.full = flat
        for p, o, s in zip(self.params, self.offsets, self.shapes):
            p.data = flat[o:o + _size(s)].reshape(s)

    def materialized(self):
        return self.full is not None

    def free(self):
        """Drop the full buffer: every parameter becomes an empty placeholder."""
        freed = self.full is not None
        if freed:
            try:
                self._stale = weakref.ref(self.full)
            except TypeError:   # an array type without weak references: no reuse
                self._stale = None
            if self.pool is not None:
                self.pool.give(self.full)
        self.full = None
        for p in self.params:
            p.data = xp.empty((0,), dtype=self.dtype)
        if freed:
            hooks.event("free", self.name)

    def gather_buffer(self):
        """Where the next all-gather lands: the freed buffer if a graph node still holds a
        view of it (then it was never really freed, and gathering into it again avoids a
        second copy); else a free one of the pool (pages already mapped: no faults); else a
        fresh (Ψ_pad,) mapping (its free unmaps it)."""
        old = self._stale() if self._stale is not None else None
        self._stale = None
        if self.pool is not None:
            return self.pool.take(self.padded, self.dtype, prefer=old)
        return old if old is not None else mapped_empty(self.padded, self.dtype)

    def finish_gather(self, buf):
        self._attach(buf)

    # ------------------------------------------------------------ gradients
    def ensure_grad_views(self):
        """Give every parameter a ``.grad`` that is a view into ``grad_flat``,
        allocating it (zeros) if needed, so autograd accumulates in place."""
        if self.grad_flat is None:
            self.grad_flat = (mapped_empty(self.padded, self.dtype) if self.pool is None else
                              self.pool.take(self.padded, self.dtype))   # (Ψ_pad,)
            self.grad_flat[...] = 0
            for p in self.params:
                p.grad = None
        for p, o, s in zip(self.params, self.offsets, self.shapes):
            if p.grad is None:
                view = self.grad_flat[o:o + _size(s)]
                view[...] = 0
                p.grad = view.reshape(s)

    def drop_grads(self):
        """Forget the full gradient (stages 2, 3): parameters' .grad -> None (its buffer back
        to the pool, if any)."""
        if self.pool is not None and self.grad_flat is not None:
            self.pool.give(self.grad_flat)
        self.grad_flat = None
        for p in self.params:
            p.grad = None

    def zero_grad(self):
        if self.grad_flat is not None:
            self.grad_flat[...] = 0
        self.ready, self.used = 0, False

    # ------------------------------------------------------------ layout
    def unflatten(self, flat):
        """name -> view of parameter i in a (Ψ_pad,) flat buffer."""
        return {n: flat[o:o + _size(s)].reshape(s) for n, o, s in zip(self.names, self.offsets, self.shapes)}

    def flatten(self, arrays):
        """The (Ψ_pad,) flat buffer of ``arrays`` (name -> array of any backend, e.g.
        a single-process state_dict): what this unit's gathered buffer would hold."""
        flat = xp.zeros(self.padded, dtype=self.dtype)
        for n, o, s in zip(self.names, self.offsets, self.shapes):
            flat[o:o + _size(s)] = xp.asarray(arrays[n]).reshape(-1)
        return flat

    def __repr__(self):
        return (f"<FlatParamUnit {self.name}: {len(self.params)} params, Ψ_u={self.numel}, "
                f"Ψ_pad={self.padded}, shard [{self.lo}, {self.hi})>")


def _size(shape):
    n = 1
    for d in shape:
        n *= d
    return n
