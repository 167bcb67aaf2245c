"""Expert parallelism (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): the experts
of every MoE layer split over the ep ranks of each data-parallel group, tokens sent to
their experts and back over all_to_all_v.

    mesh = DeviceMesh(dp=4, ep=2)       # ep groups: dp ranks {0, 1}, {2, 3}; edp: {0, 2}, {1, 3}
    model = parallelize(GPT(cfg, seed), mesh)   # cfg.n_expert = E: E/ep experts per rank

Each rank trains on its B/dp rows. In an MoE layer (pdist/models/moe.py) it routes its own
tokens (so the capacity and the drops are those of its shard), sorts the kept rows by
expert, and ``ExpertDispatch`` runs

    counts   all_to_all of the per-expert row counts (ep x E/ep integers)
    dispatch all_to_all_v: the rows for experts [q E/ep, (q+1) E/ep) go to ep rank q
    experts  each local expert on its rows (from every source), regrouped by expert
    combine  all_to_all_v back to the source, in the source's order

and backward the two all-to-alls again, in reverse (AllToAllV's backward). Bytes per MoE
layer on ep rank r: the rows it sends the others plus the rows it sends back, times
C * itemsize, in forward and again in backward; for a uniform routing of N tokens, top-k,
each all-to-all moves N k C (ep - 1)/ep elements (issue 26's tokens*k*h*(ep-1)/ep, twice
forward, twice backward).

Gradients. The loss of the global batch is L = (1/dp) sum_s L_s (L_s: shard s's mean,
plus its aux loss). A dense parameter (attention, norms, the gate) gets dL_s on rank s:
averaged over dp. Expert e's holder receives, through the combine's backward, the
gradients of every shard of its ep group, so it holds sum_{s in group} dL_s/dθ_e; summed
over the edp group (the dp/ep replicas of e) and divided by dp it is dL/dθ_e. (Averaging
over edp instead would scale expert gradients by ep: the bug the equivalence test catches.)

What composes (tests/test_expert_parallel.py, every piece against one process, float64):

    ZeRO-1/2/3   ExpertParallel(.., zero_stage) holds ExpertZeRO(.., dp_group, expert_group=edp_group):
                 the dense units (attention, norms, the gate) sharded over dp as always; one
                 unit per expert, sharded over its edp group (Megatron's expert-data-parallel
                 group; DeepSpeed-MoE shards experts the same way), its gradient reduce-scattered
                 over edp with op sum and scaled by 1/dp, after backward and in unit order (the
                 ranks see different experts complete). An expert no rank gave a gradient in a
                 step (no token chose it) keeps none, and AdamW skips it, as on one process
                 (one all-reduce of a flag per expert over edp; zero/units.py).
    tp           the MoE layer is whole on every tp rank (gate and experts replicated over tp,
                 no expert-internal tensor parallelism): it sits between a row-parallel output
                 and a column-parallel input, where activations and their gradients are whole,
                 so each tp rank routes the same tokens and holds complete gradients. Sequence
                 parallelism is refused (a tp rank would route only its T/tp tokens).
    pp           MoE layers inside the stages, the ep group per stage (the dp ranks of a stage),
                 any schedule (1F1B, interleaved, ZB-H1/ZB-V: the all-to-alls run in B). Each
                 stage's load-balancing loss rides on its output's backward (moe.stage_aux, as
                 Megatron's MoEAuxLossAutoScaler) and joins the reported loss over pp.
    not yet      cp > 1 (refused by parallelize).

Checkpoints (pdist/checkpoint): an expert is its own tensor under its single-process name
(``global_name``), so ep rank r saves experts [r E/ep, (r+1) E/ep) whole (under ZeRO their
edp boxes) and any ep, or one process, loads them by box intersection like any cut.
"""
import numpy as np

from pdist import comm, nn
from pdist.data import shard
from pdist.engine.autograd import Function
from pdist.engine.backend import to_numpy, xp
from pdist.engine.shape_ops import concat
from pdist.models.moe import Gather, moe_layers, moe_stats
from pdist.models.plan import expert_of, plan_of
from pdist.parallel.base import Local, ParallelModule, Strategy
from pdist.parallel.zero.experts import ExpertZeRO


class AllToAllV(Function):
    """y = all_to_all_v(x) over ``group`` with (send, recv) row counts; dx = the reverse
    all_to_all_v of dy (recv, send)."""
    fresh_grads = True

    def forward(self, x, group=None, send=(), recv=()):
        self.group, self.send, self.recv = group, list(send), list(recv)
        out = xp.empty((sum(self.recv),) + x.shape[1:], dtype=x.dtype)
        group.all_to_all_v(out, xp.ascontiguousarray(x), self.send, self.recv)
        return out

    def backward(self, g):
        gx = xp.empty((sum(self.send),) + g.shape[1:], dtype=g.dtype)
        self.group.all_to_all_v(gx, xp.ascontiguousarray(g), self.recv, self.send)
        return gx, None, None, None


class ExpertDispatch:
    """A layer's ``apply_experts`` under expert parallelism: ``layer.experts`` holds the
    experts [first, first + E/ep) of ep rank ``group.rank``."""

    def __init__(self, layer, group, n_expert):
        self.layer, self.group, self.E = layer, group, n_expert
        self.El = n_expert // group.size

    def __call__(self, xs, counts):
        ep, El = self.group.size, self.El
        mine = np.ascontiguousarray(np.asarray(counts, np.int64))           # (E,) rows per expert, mine
        theirs = np.empty_like(mine)
        self.group.all_to_all(theirs, mine)                                 # theirs[q El + e]: q's rows for my e
        send = mine.reshape(ep, El).sum(1).tolist()
        by_src = theirs.reshape(ep, El)                                     # (ep, El)
        recv = by_src.sum(1).tolist()
        xr = AllToAllV.apply(xs, group=self.group, send=send, recv=recv)   # (R, C), by source, then expert
        perm, per_expert = regroup(by_src)
        ys = self._local(Gather.apply(xr, xp.asarray(perm)), per_expert, by_src)   # by expert, then source
        back = Gather.apply(ys, xp.asarray(np.argsort(perm, kind="stable")))
        return AllToAllV.apply(back, group=self.group, send=recv, recv=send)   # (M, C), xs's order

    def _local(self, xe, per_expert, by_src):
        """Each local expert on its rows (from every source), regrouped by expert: (R, C)."""
        outs, a = [], 0
        for e, c in enumerate(per_expert):
            if c:
                outs.append(self.layer.experts[e](xe[a:a + c]))
            a += c
        return concat(outs, axis=0) if len(outs) > 1 else outs[0] if outs else xe * 0.0


def regroup(by_src):
    """(perm, per_expert): row order of the received rows (source-major, expert-minor) that
    lists them expert-major, source-minor; and each local expert's row count."""
    ep, El = by_src.shape
    start = np.concatenate([[0], np.cumsum(by_src.reshape(-1))])[:-1].reshape(ep, El)
    perm = [np.arange(start[q, e], start[q, e] + by_src[q, e]) for e in range(El) for q in range(ep)]
    perm = np.concatenate(perm).astype(np.int64) if perm else np.zeros(0, np.int64)
    return perm, [int(c) for c in by_src.sum(0)]


def split_experts(module, mesh):
    """Keep experts [r E/ep, (r+1) E/ep) of every MoE layer of ``module`` on ep rank r and
    route through ``ExpertDispatch``; every parameter of the layers keeps its single-process
    name (``global_name``: expert e stays ``...experts.<e>...``). Before ZeRO builds its units."""
    ep, r = mesh.ep_world_size, mesh.ep_rank
    for name, layer in moe_layers(module):
        if layer.n_expert % ep:
            raise ValueError(f"expert parallelism: {name} has n_expert={layer.n_expert} experts, which "
                             f"do not split over ep={ep} ranks; choose n_expert divisible by ep")
        for pname, p in layer.named_parameters(prefix=name):
            p.global_name = getattr(p, "global_name", pname)
        if ep > 1 and not isinstance(layer.apply_experts, ExpertDispatch):
            El = layer.n_expert // ep
            layer.experts = nn.ModuleList(list(layer.experts)[r * El:(r + 1) * El])
            layer.apply_experts = ExpertDispatch(layer, mesh.ep_group, layer.n_expert)


class ExpertParallel(ParallelModule):
    """Data parallelism over ``mesh.dp_group`` with each MoE layer's experts split over
    ``mesh.ep_group`` (see the module docstring). ``ep = 1``: every rank holds every expert
    and the dispatch stays local; the gradients are reduced as above (edp = dp).
    ``zero_stage`` 1-3: ``ExpertZeRO(inner, stage, dp_group, expert_group=edp_group)`` inside does
    the batch, the loss and every reduction: dense units sharded over dp, each layer's
    experts over edp (pdist/parallel/zero/units.py)."""

    def __init__(self, inner, mesh, zero_stage=0):
        inner = inner if isinstance(inner, Strategy) else Local(inner)
        split_experts(inner.module, mesh)
        self.zero_stage = zero_stage
        if zero_stage:
            inner = ExpertZeRO(inner, zero_stage, mesh.dp_group, expert_group=mesh.edp_group)
        super().__init__(inner, mesh.dp_group)
        self.dp_rank, self.dp_world_size = self.group.rank, self.group.size
        self.loss_weight = 1.0 / self.dp_world_size
        self.ep_group, self.edp_group = mesh.ep_group, mesh.edp_group
        self._dense, self._experts = [], []
        if zero_stage:
            return
        self.inner.materialize()
        plan = plan_of(self.module)
        for n, p in self.named_parameters():
            (self._experts if expert_of(plan, getattr(p, "global_name", n)) else self._dense).append(p)

    def span_group(self):
        """The dp group when nothing but ZeRO lies between this and ``Local`` (its ranks hold the
        whole model together: a mesh over a sub-group keeps its state-dict collectives there)."""
        return self.group if len(self.chain()) == 2 + bool(self.zero_stage) else comm.get_world()

    def local_batch(self, x, y):
        """This rank's rows of the global batch: [r B/dp, (r+1) B/dp) (ZeRO's cut, under ZeRO)."""
        if self.zero_stage:
            return self.inner.local_batch(x, y)
        return self.inner.local_batch(*shard((x, y), self.dp_rank, self.dp_world_size))

    def reduce_stats(self, v):
        """The loss over dp (ZeRO's, under ZeRO: it already weighted and summed it)."""
        return self.inner.reduce_stats(v) if self.zero_stage else super().reduce_stats(v)

    def moe_stats(self, reset=True):
        """moe_stats of the whole batch: each layer's tokens per expert, routed and dropped
        rows, summed over the dp ranks (every rank gets the same). Collective over dp."""
        parts = self.group.all_gather_object(moe_stats(self.module, reset))
        out = {}
        for name in parts[0]:
            ss = [p[name] for p in parts]
            out[name] = {"tokens": np.sum([s["tokens"] for s in ss], 0).tolist(),
                         "routed": np.sum([s["routed"] for s in ss], 0).tolist(),
                         "dropped": sum(s["dropped"] for s in ss), "calls": sum(s["calls"] for s in ss)}
        return out

    def finish_grad_sync(self):
        """Dense gradients averaged over dp; expert gradients summed over edp, divided by dp
        (under ZeRO: ZeRO's reduce-scatters do both)."""
        self.inner.finish_grad_sync()
        _reduce(self._dense, self.group, "avg", 1.0)
        _reduce(self._experts, self.edp_group, "sum", 1.0 / self.dp_world_size)


def _reduce(params, group, op, scale):
    """One flat all-reduce of ``params``' gradients over ``group``; a gradient missing on every
    rank stays None (as on one process, where AdamW then skips it: an expert no token chose),
    one missing only here counts as zeros. The flags travel at the buffer's end."""
    if not params:
        return
    here = [p.grad is not None for p in params]
    flat = xp.concatenate([p.grad.reshape(-1) if h else xp.zeros(p.size, p.dtype) for p, h in zip(params, here)]
                          + [xp.asarray(here, dtype=params[0].dtype)])
    if group.size > 1:
        group.all_reduce(flat, op=op)
    if scale != 1.0:
        flat *= scale
    anywhere = to_numpy(flat[-len(params):]) > 0
    a = 0
    for p, h, used in zip(params, here, anywhere):
        g = flat[a:a + p.size].reshape(p.shape)
        if not used:
            p.grad = None
        elif h:
            p.grad[...] = g
        else:
            p.grad = g.copy()
        a += p.size


__all__ = ["ExpertParallel", "ExpertDispatch", "AllToAllV", "regroup", "split_experts"]
