"""ZeRO over a mixture of experts (``ExpertParallel(.., zero_stage)``, pdist/parallel/expert_parallel.py).

Expert parallelism holds experts [r E/ep, (r+1) E/ep) on ep rank r; the dp / ep ranks that
hold the same experts form the edp group (Megatron's expert-data-parallel group;
DeepSpeed-MoE shards experts the same way). ``ExpertZeRO`` shards the dense units over dp as
``ZeRO`` does, and gives each expert a unit of its own, sharded over edp (units.py):

    dL/dθ_e = (1/dp) sum_{s in edp} g_s     (each edp rank holds its ep group's sum for e)

so an expert unit's gradient is reduced with op "sum" over edp and scaled by 1/dp (the
unit's ``scale``). Its reductions wait for the end of backward (``deferred``: the ranks of
an edp group see other experts' gradients complete, and every rank must issue the same
collectives in the same order), in unit order; under stage 3 an expert stays gathered until
then. An expert no rank gave a gradient in a step (no token chose it) keeps none, and AdamW
skips it, as on one process (``unused_experts``: one all-reduce of a flag per expert).
"""
from pdist.parallel.zero.units import unused_experts
from pdist.parallel.zero.zero import ZeRO


class ExpertZeRO(ZeRO):
    """``ExpertZeRO(inner, stage, dp_group, expert_group=edp_group)``: ZeRO with one unit per
    expert, sharded over ``expert_group`` (module docstring)."""

    def __init__(self, module, stage, group=None, units=None, prefetch=True, expert_group=None):
        self.expert_group = expert_group
        super().__init__(module, stage, group, units, prefetch)

    def _grad_ready(self, u):
        if u.deferred:                    # an expert: reduced (and freed) after backward
            u.ready += 1
            return
        super()._grad_ready(u)

    def _finish_reductions(self):
        unused = unused_experts(self.units)
        for u in self.units:              # an expert no rank used: no gradient, as on one process
            if id(u) in unused:
                u.drop_grads()
                u.shard.grad = None
                if self.stage == 3:
                    u.free()
                self._reduced.add(id(u))  # (nothing to reduce)
        super()._finish_reductions()

    def _keep_shard(self, u, out):
        if u.scale is not None:           # an expert: its edp sum times 1/dp
            (u.grad_flat if self.stage == 0 else out)[...] *= u.scale
        super()._keep_shard(u, out)


__all__ = ["ExpertZeRO"]
