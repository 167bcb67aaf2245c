"""Expert parallelism in the deterministic mode (docs/deterministic.md; the contract:
pdist/parallel/deterministic/policy.py).

One process runs granule j's MoE layer on granule j's tokens alone: expert e's GEMMs see
the c_e^j rows of j routed to e, in the order ``route`` sorts them, and its weight
gradient d_j(θ_e) is one leaf of the granule tree. Under expert parallelism (GShard,
Lepikhin et al., 2020) over ep ranks, the ranks of an ep group run their granules in
lockstep: at step i of the granule loop, ep rank q of ep group k runs global granule
(k ep + q) n + i (n = G / dp), and the holder of expert e receives the rows of ep
granules at once, one per source rank. So in the mode:

* Forward, per source block. ``ExpertDispatch`` calls each local expert once per source q,
  on q's rows alone (``ExpertTrees.run``): the shapes and data of one process running
  that granule's expert, so its bits, and no GEMM mixes the rows of two granules.
* Backward, per source leaf. Each such call runs on handles of its own to the expert's
  weights (a leaf Tensor on the same array, swapped in for the call), so autograd leaves
  the gradient of source q's granule alone in the handle's ``.grad``: d_j(θ_e), bit for
  bit one process's.
* A tree per ep group. After each granule's backward (a granule hook), the handles'
  gradients of source q form leaf q n + i of this rank's expert tree (flat fp32 over its
  experts; an expert the source did not route to: zeros, as in one process's leaf). The
  ep group's block of ep n granules is aligned (ep divides dp, a power of two), so its
  root is the subtree (log2(ep n), k); recursive doubling over the edp group (the dp / ep
  replicas of these experts, where this rank is k) joins the blocks into the root of all
  G granules (``finish``), which replaces the experts' slots of the dense tree (joined
  over dp, where those slots held zeros), before the one rounding.

Capacity is a property of one routing call, and in the mode every call routes one granule
on its own rank: capacity and drops are per granule, the same on every layout.
"""
import numpy as np

from pdist.engine.autograd import Tensor
from pdist.engine.backend import xp
from pdist.engine.shape_ops import concat
from pdist.models.moe import moe_layers
from pdist.parallel.deterministic.join import join_all, join_root
from pdist.parallel.deterministic.policy import GranuleTree, InMode
from pdist.parallel.expert_parallel import ExpertDispatch, split_experts


class WeightHandle(Tensor):
    """A leaf on parameter ``param``'s array, read when used (ZeRO-3 re-gathers the array
    between the forward and the backward), with a ``.grad`` of its own."""

    data = property(lambda self: self.param.data)

    def __init__(self, param):
        self.param, self.grad, self.requires_grad = param, None, True
        self._ctx = self._hooks = self._post_acc_hooks = self.name = None


class ExpertTrees:
    """The per-source expert trees of one rank (module docstring). ``params``: the rank's
    parameters in the policy's order (``det.bind``); ``experts``: the ids of those that are
    its local experts' weights. Registers itself as ``det.experts`` and a granule hook."""

    def __init__(self, det, params, experts, mesh):
        offs = np.cumsum([0] + det.sizes)
        self.slots = [(p, int(offs[i]), int(offs[i + 1])) for i, p in enumerate(params) if id(p) in experts]
        self.size = sum(b - a for _, a, b in self.slots)
        self.det, self.ep, self.edp = det, mesh.ep_world_size, mesh.edp_group
        self.handles, self.tree, self.step = {}, GranuleTree(), 0
        det.granule_hooks.append(self.after_granule)
        det.experts = self

    def run(self, expert, source, x):
        """expert(x) on the rows of ep rank ``source``, through that source's weight handles."""
        swapped = []
        for m in expert.modules():
            for name, p in m._params.items():
                h = self.handles.get((source, id(p)))
                if h is None:
                    h = self.handles[(source, id(p))] = WeightHandle(p)
                object.__setattr__(m, name, h)
                swapped.append((m, name, p))
        try:
            return expert(x)
        finally:
            for m, name, p in swapped:
                object.__setattr__(m, name, p)

    def after_granule(self):
        """Each source's leaf of the granule just run: the handles' gradients, flat fp32."""
        n = self.det.granules // self.det.shards
        for q in range(self.ep):
            leaf, o = xp.zeros(self.size, dtype=np.float32), 0                 # (Ψ_experts,)
            for p, a, b in self.slots:
                h = self.handles.get((q, id(p)))
                if h is not None and h.grad is not None:
                    leaf[o:o + b - a] += h.grad.reshape(-1).astype(np.float32)
                o += b - a
            self.tree.add(q * n + self.step, leaf)
        self.handles.clear()
        self.step += 1

    def finish(self):
        """After the dense join over dp: the experts' root over edp, into their slots."""
        level, _, root = join_root(self.tree.root(), self.edp)
        self.tree, self.step = GranuleTree(), 0
        if level != self.det.root[0]:
            raise RuntimeError(f"deterministic mode: the experts' tree holds {1 << level} granules, the dense "
                               f"tree {1 << self.det.root[0]}; every ep rank must run the same granules")
        buf, o = self.det.root[2], 0
        for _, a, b in self.slots:
            buf[a:b] = root[o:o + b - a]
            o += b - a


class SourceDispatch(ExpertDispatch):
    """``ExpertDispatch`` in the mode: each local expert once per source rank, on that source's
    rows alone, through the source's weight handles (``ExpertTrees.run``)."""

    trees = None

    def _local(self, xe, per_expert, by_src):
        outs, a = [], 0
        for e in range(len(per_expert)):
            for q in range(len(by_src)):              # source q's rows alone, its own leaf
                n = int(by_src[q, e])
                if n:
                    outs.append(self.trees.run(self.layer.experts[e], q, xe[a:a + n]))
                a += n
        return concat(outs, axis=0) if len(outs) > 1 else outs[0] if outs else xe * 0.0


def check_experts(n_expert, pipeline=False):
    """What the mode refuses for a mixture of ``n_expert`` experts, the same on every rank,
    before any collective."""
    if n_expert and pipeline:
        raise ValueError(f"deterministic mode: a mixture of experts (n_expert={n_expert}) under a pipeline is "
                         f"not a granule tree yet (the stages' micro-batch leaves do not keep the experts' "
                         f"per-source trees); use pp = 1 and chunks = 1, or deterministic=False")


class ExpertTreeJoin(InMode):
    """``ExpertParallel`` in the mode: what it refuses, the policy re-bound to this rank's
    experts, the batch's granules cut over dp (ZeRO's own, under ZeRO), under ep > 1 the
    per-source trees the dispatchers feed; the dense trees joined over dp and the experts' over
    edp (under ZeRO: in ZeRO's sync)."""

    def __init__(self, inner, mesh, zero_stage=0):
        split_experts(inner.module, mesh)             # (idempotent: the strategy's own call is then a no-op)
        det, layers = inner.deterministic, moe_layers(inner.module)
        check_experts(layers[0][1].n_expert if layers else 0, inner.pipeline)
        det.bind(inner.parameters())
        if not zero_stage:
            det.shard_over(mesh.dp_world_size, inner.microbatches, inner.pipeline)
        if mesh.ep_world_size > 1:
            experts = {id(p) for _, layer in layers for p in layer.experts.parameters()}
            trees = ExpertTrees(det, inner.parameters(), experts, mesh)
            for _, layer in layers:
                layer.apply_experts.__class__ = SourceDispatch
                layer.apply_experts.trees = trees
        super().__init__(inner, mesh, zero_stage)

    def finish_grad_sync(self):
        if not self.zero_stage:
            join_all(self.deterministic, self.group)
        self.inner.finish_grad_sync()


__all__ = ["ExpertTrees", "SourceDispatch", "ExpertTreeJoin", "check_experts"]
