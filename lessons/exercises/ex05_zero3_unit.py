"""Exercise 05 (10 points): ZeRO-3 (FSDP) for one unit.

Task. A unit (a transformer block, ln_f, the root) keeps only its flat shard between
uses. Write the three moves; pdist's ``ZeRO`` (stage 3) calls them from its hooks:
``gather_unit`` before the unit's forward and again before its backward, ``free_unit``
right after its forward and after its backward, ``reduce_unit_grads`` once the unit's
gradients are complete.

The unit (a ``pdist.parallel.zero.flat_param.FlatParamUnit``) has: ``params``, ``offsets``,
``shapes`` (parameter i lives at flat[offsets[i] : offsets[i] + size_i]), ``padded``
(Psi_pad = ceil(Psi_u / N) * N), ``lo``, ``hi`` (this rank's shard is flat[lo:hi]),
``dtype``, ``shard`` (a Tensor: ``shard.data`` (Psi_pad/N,) is what persists; the
optimizer updates it from ``shard.grad``), ``full`` (the gathered flat buffer, or None
when freed), ``grad_flat`` ((Psi_pad,) gradients, each ``p.grad`` a view into it).

Math (Rajbhandari et al. 2020, sec. 5.3, P_os+g+p). Per step each unit is all-gathered
twice (forward, backward: 2 (n-1)/n Psi) and its gradient reduce-scattered once
((n-1)/n Psi): 3 Psi in all, 1.5x DDP, for memory 16Psi/N. Freeing after forward is
what makes memory scale: only the unit being computed is ever whole. Autograd reads
parameters through ``p.data`` at backward time, which is why gathering again before
backward works.

Hints.
* gather: a fresh ``xp.empty(unit.padded, unit.dtype)``, ``group.all_gather(flat,
  unit.shard.data)``, then ``p.data = flat[o:o + p_size].reshape(shape)`` for every
  parameter, and ``unit.full = flat``.
* free: ``p.data = xp.empty((0,), unit.dtype)`` for every parameter; ``unit.full = None``.
* reduce: ``group.reduce_scatter(out, unit.grad_flat, op="avg")`` with out of
  ``unit.hi - unit.lo`` elements; ``unit.shard.grad = out``; then drop the full
  gradient (``unit.grad_flat = None`` and every ``p.grad = None``).

Grade: ``python -m pdist.grade 05`` (3 ranks, so units are padded; parameters are views
of unit.full; free leaves empty parameters and unit.full None; shard.grad is the
average and the full gradient is dropped; equal to single-process training; every unit
freed after forward; two gathers per unit per step; bytes 3(n-1)/n*Psi_pad*b).
"""
from pdist.engine.backend import xp  # noqa: F401


def gather_unit(unit, group):
    """All-gather the unit's shards and make every parameter a view of the full buffer."""
    raise NotImplementedError("exercise: gather the unit")


def free_unit(unit):
    """Drop the full parameters: only the shard stays."""
    raise NotImplementedError("exercise: free the unit")


def reduce_unit_grads(unit, group):
    """Reduce-scatter (average) the unit's gradient into unit.shard.grad; drop the full one."""
    raise NotImplementedError("exercise: reduce-scatter the unit's gradient")
