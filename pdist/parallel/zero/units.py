"""ZeRO's units: which modules they are, their flat buffers, and where each shard sits.

A unit is a set of parameters flattened into one buffer (flat_param.py) and gathered,
reduced and freed together. By default the units are the modules the model's plan names
(``ModelPlan.zero_units``: GPT-2's blocks and final LayerNorm); every parameter in no
unit forms the *root* unit. Each rank's shard of a unit is a flat range of Ψ_pad
elements; ``shard_pieces`` says which boxes of the single-process tensors it covers.
"""
import math

from pdist.engine.backend import to_numpy, xp
from pdist.models.moe import moe_layers
from pdist.models.plan import plan_of, select
from pdist.parallel.layout import reshard_flat
from pdist.parallel.zero.flat_param import FlatParamUnit


def default_units(model):
    """The modules the model's plan names as units (``ModelPlan.zero_units``, in forward
    order; those a pipeline stage does not hold are absent); none: one root unit."""
    named = list(model.named_modules())
    return [m for pattern in plan_of(model).zero_units for _, m in select(pattern, named)]


def build_units(inner, module, unit_modules, group, stage, expert_group=None):
    """(root, units, hooked): the root unit (or None); [root] + one FlatParamUnit per module of
    ``unit_modules`` + one per expert; and the MoE layer of each expert unit, in order (its
    stage-3 hooks go there: every rank runs the layer, not every rank each expert). ``inner``
    names the parameters; each parameter is in one unit only. Stages >= 1 shard the buffers
    over ``group``; stages <= 2 keep the full parameters. ``expert_group`` (expert
    parallelism's edp group, the replicas of this rank's experts): each expert is a unit of
    its own, sharded over it, its gradient summed over it and divided by the dp size (reduced
    after backward, in unit order: the ranks see different experts' gradients complete);
    without it, experts are in the units like any parameter."""
    names = {id(p): n for n, p in inner.named_parameters()}
    layers = [m for _, m in moe_layers(module)] if expert_group is not None else []
    owner = {id(p): "experts" for m in layers for p in m.experts.parameters()}
    groups = []
    for i, m in enumerate(unit_modules):
        if m is module:
            raise ValueError("ZeRO units: do not list the model itself; its leftover parameters "
                             "already form the root unit")
        named = []
        for _, p in m.named_parameters():
            if owner.get(id(p)) == "experts":
                continue
            if id(p) not in names:
                raise ValueError(f"ZeRO unit {i} ({type(m).__name__}) has a parameter that is not "
                                 f"in the model: pass sub-modules of the wrapped model")
            if id(p) in owner:
                raise ValueError(f"parameter {names[id(p)]} is in ZeRO units {owner[id(p)]} and {i}: "
                                 f"each parameter must belong to exactly one unit")
            owner[id(p)] = i
            named.append((names[id(p)], p))
        groups.append((f"unit{i}", named))
    root = [(n, p) for n, p in inner.named_parameters() if id(p) not in owner]
    sharded, keep_full = stage >= 1, stage <= 2
    units = [FlatParamUnit(name, named, group, sharded, keep_full) for name, named in groups]
    root = FlatParamUnit("root", root, group, sharded, keep_full) if root else None
    experts, hooked = [], []
    for i, m in enumerate(layers):         # one unit per expert, hooked on its layer (which every rank runs)
        for e, x in enumerate(m.experts):
            u = FlatParamUnit(f"experts{i}.{e}", [(names[id(p)], p) for p in x.parameters()], expert_group,
                              sharded, keep_full)
            u.op, u.scale, u.deferred = "sum", 1.0 / group.size, True
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda t, u=u: setattr(u, "used", True))
            experts.append(u)
            hooked.append(m)
    return root, ([root] if root else []) + units + experts, hooked


def unused_experts(units):
    """The ids of the expert units that no rank of their group gave a gradient this step (an
    expert no token chose): one all-reduce (max) of a flag per unit. One process skips such an
    expert in AdamW (its gradients are None); ZeRO then skips its shard the same way."""
    ex = [u for u in units if u.deferred]
    if not ex:
        return set()
    flags = xp.asarray([float(u.used) for u in ex])
    if ex[0].group.size > 1:
        ex[0].group.all_reduce(flags, op="max")
    return {id(u) for u, f in zip(ex, to_numpy(flags)) if f == 0}


def check_same_on_all_ranks(group, stage, units):
    """Every rank of ``group`` wraps the same model with the same stage (one gather)."""
    mine = (stage, [u.numel for u in units], str(units[0].dtype))
    everyone = group.all_gather_object(mine)
    if any(o != mine for o in everyone):
        raise ValueError("ZeRO: ranks disagree on (stage, unit sizes, dtype): "
                         + "; ".join(f"rank {r}: {o}" for r, o in enumerate(everyone))
                         + " -- every rank must wrap the same model with the same stage")


def shard_pieces(units, inner_pieces):
    """Where each unit's shard sits in the single-process tensors (layout.py): the
    shard's flat range cut into boxes of each parameter it overlaps; no padding."""
    by_tensor = {}
    for pc in inner_pieces:
        by_tensor.setdefault(id(pc.tensor), []).append(pc)
    out = []
    for u in units:
        for p, o, shape in zip(u.params, u.offsets, u.shapes):
            a, b = max(u.lo, o), min(u.hi, o + math.prod(shape))
            if a < b:
                out += reshard_flat(by_tensor[id(p)], shape, a - o, b - o, u.shard, u.lo - o)
    return out


__all__ = ["default_units", "build_units", "check_same_on_all_ranks", "shard_pieces", "unused_experts"]
