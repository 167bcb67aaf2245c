"""ZeRO stages 0-3 over FSDP-style flat sharded units (Rajbhandari et al., 2020).

    zero.py        the strategy: its phases, the gradients' reductions, what a rank holds
    gather.py      stage 3: each unit's parameters gathered around its forward and backward
    units.py       which modules are units, their flat buffers, where each shard sits
    flat_param.py  one unit: its parameters in one flat buffer, this rank's shard
    experts.py     ExpertZeRO: a mixture of experts, each expert a unit over the edp group
    hsdp.py        HSDP: ZeRO inside a shard group, each shard's gradient averaged across the replicas
"""
from pdist.parallel.zero.units import default_units
from pdist.parallel.zero.zero import STAGES, ZeRO
from pdist.parallel.zero.hsdp import HSDP, check_hybrid

__all__ = ["ZeRO", "HSDP", "STAGES", "default_units", "check_hybrid"]
