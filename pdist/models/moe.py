"""A mixture-of-experts MLP block (Shazeer et al., 2017; GShard, Lepikhin et al., 2020;
Switch Transformer, Fedus et al., 2021; Mixtral, Jiang et al., 2024), for both models.

For the N = B*T tokens x_n of one forward call (a data-parallel shard of the batch):

    p_n   = softmax(x_n W_gate)                        # (N, E) router probabilities
    S_n   = top-k experts of p_n (ties: lower index)   # (N, k)
    w_ne  = p_ne / sum_{e' in S_n} p_ne'   (e in S_n)  # gate weights renormalised over the top-k (Mixtral)
    y_n   = sum_{e in S_n, kept} w_ne * expert_e(x_n)  # (N, C)

GPT's experts are its GELU MLP, Llama's its SwiGLU MLP (``make_expert``). The gradient
reaches the router through the gate weights w (and through the auxiliary loss).

Capacity (``capacity_factor`` c; None: dropless, the default). Each expert takes at most
``ceil(c * N * k / E)`` of this call's N*k assignments, first choices before second
choices, in token order (GShard's priority); the others are dropped (that token's term is
0; the block's residual carries it). The capacity is a property of the call's own tokens:
a data-parallel rank drops on its B/dp rows what one process drops on the same shard
(``Local(model, microbatches=dp)``). Drops and tokens per expert are counted
(``MoE.stats``: ``tokens`` per expert after drops, ``routed`` before, ``dropped``) and
read with ``moe_stats(model)``.

Load-balancing loss (Switch, eq. 4; GShard): with f_e the fraction of the N*k
assignments routed to e (before drops, no gradient) and P_e = mean_n p_ne,

    aux = router_aux_loss_coef * E * sum_e f_e P_e            (1 for a uniform router)

Each MoE layer keeps its ``aux_loss``; CausalLM.forward adds them to the loss.

Expert parallelism (pdist/parallel/expert_parallel.py) replaces ``apply_experts``: the
rows grouped by expert go to the ranks that hold them over all_to_all_v and come back.
"""
import math

import numpy as np

from pdist import nn
from pdist.engine import functional as F
from pdist.engine.autograd import Function
from pdist.engine.backend import scatter_add, to_numpy, xp
from pdist.engine.ops import mul, sum as tsum
from pdist.engine.shape_ops import concat, reshape, transpose


class IndexAdd(Function):
    """out (n, C) = zeros; out[idx[m]] += y[m] (repeated rows add);  dy = g[idx]."""
    fresh_grads = True

    def forward(self, y, idx, n=0):
        self.idx = idx
        out = xp.zeros((n, y.shape[1]), dtype=y.dtype)
        scatter_add(out, idx, y)
        return out

    def backward(self, g):
        return g[self.idx], None


class Gather(Function):
    """y = x[idx] along rows (idx may repeat);  dx = scatter-add of g at idx."""
    fresh_grads = True

    def forward(self, x, idx):
        self.idx, self.shape = idx, x.shape
        return x[idx]

    def backward(self, g):
        gx = xp.zeros(self.shape, dtype=g.dtype)
        scatter_add(gx, self.idx, g)
        return gx, None


def route(probs, k, capacity_factor):
    """The routing of one call, on the host (NumPy; deterministic ties): returns
    ``top`` (N, k) expert ids, ``kept`` the flat assignment ids a = j*N + n that survive the
    capacity, sorted by expert (then choice j, then token n), ``counts`` (E,) kept rows per
    expert, ``routed`` (E,) before drops."""
    N, E = probs.shape
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]           # (N, k)
    flat = top.T.reshape(-1)                                         # a = j*N + n: first choices first
    order = np.argsort(flat, kind="stable")
    routed = np.bincount(flat, minlength=E)
    if capacity_factor is None:
        return top, order, routed, routed
    cap = int(math.ceil(capacity_factor * N * k / E))
    start = np.concatenate([[0], np.cumsum(routed)[:-1]])
    rank_in_expert = np.arange(order.size) - np.repeat(start, routed)
    kept = order[rank_in_expert < cap]
    return top, kept, np.minimum(routed, cap), routed


class MoE(nn.Module):
    """The MoE MLP: ``gate`` (a Linear C -> E, no bias), ``experts`` (E MLPs C -> C); see the
    module docstring. ``expert_ids``: the global ids of the experts this module holds (all
    of them on one process; E/ep under expert parallelism)."""

    def __init__(self, gate, experts, top_k, capacity_factor=None, aux_coef=0.0):
        super().__init__()
        self.gate = gate
        self.experts = nn.ModuleList(experts)
        self.n_expert, self.top_k = len(self.experts), int(top_k)
        self.capacity_factor, self.aux_coef = capacity_factor, float(aux_coef)
        self.aux_loss = None
        self.reset_stats()

    def reset_stats(self):
        E = self.n_expert
        self.stats = {"tokens": np.zeros(E, np.int64), "routed": np.zeros(E, np.int64), "dropped": 0, "calls": 0}

    def forward(self, x):
        lead, C = x.shape[:-1], x.shape[-1]
        x2 = reshape(x, -1, C)                                       # (N, C)
        N, k = x2.shape[0], self.top_k
        probs = F.softmax(self.gate(x2), axis=-1)                    # (N, E)
        top, kept, counts, routed = route(to_numpy(probs.data), k, self.capacity_factor)
        self._count(counts, routed)
        rows = np.repeat(np.arange(N)[:, None], k, axis=1)
        w = probs[xp.asarray(rows), xp.asarray(top)]                 # (N, k)
        w = w / tsum(w, axis=1, keepdims=True)
        wf = reshape(transpose(w, 0, 1), -1)                         # (k N,) in assignment order a = j*N + n
        tok = kept % N                                               # the token of each kept assignment
        xs = Gather.apply(x2, xp.asarray(tok))                       # (M, C), grouped by expert
        ys = self.apply_experts(xs, counts)                          # (M, C)
        ys = mul(ys, reshape(Gather.apply(wf, xp.asarray(kept)), -1, 1))
        out = IndexAdd.apply(ys, xp.asarray(tok), n=N)               # (N, C)
        self.aux_loss = self._aux(probs, routed, N * k) if self.aux_coef else None
        return reshape(out, *lead, C)

    def apply_experts(self, xs, counts):
        """Rows ``xs`` grouped by expert (``counts[e]`` rows for expert e, in order) ->
        each expert's output, in the same order."""
        outs, a = [], 0
        for e, c in enumerate(counts):
            if c:
                outs.append(self.experts[e](xs[a:a + int(c)]))
            a += int(c)
        return concat(outs, axis=0) if len(outs) > 1 else outs[0] if outs else xs * 0.0

    def _aux(self, probs, routed, n_assign):
        f = xp.asarray(routed / max(n_assign, 1), dtype=probs.data.dtype)     # (E,) no gradient
        P = tsum(probs, axis=0) * (1.0 / probs.shape[0])                     # (E,)
        return tsum(P * f) * (self.aux_coef * self.n_expert)

    def _count(self, counts, routed):
        s = self.stats
        s["tokens"] += counts
        s["routed"] += routed
        s["dropped"] += int(routed.sum() - counts.sum())
        s["calls"] += 1


def moe_layers(model):
    """[(name, MoE)] of a model, in forward order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def moe_stats(model, reset=True):
    """{layer name: {"tokens": [...], "routed": [...], "dropped": d, "calls": c}} since the last
    reset (this rank's calls; a strategy sums them over its group for a global count)."""
    out = {}
    for name, m in moe_layers(model):
        s = m.stats
        out[name] = {"tokens": s["tokens"].tolist(), "routed": s["routed"].tolist(),
                     "dropped": int(s["dropped"]), "calls": int(s["calls"])}
        if reset:
            m.reset_stats()
    return out


def aux_loss(model):
    """The sum of the MoE layers' auxiliary losses of the last forward (None: none)."""
    total = None
    for _, m in moe_layers(model):
        if m.aux_loss is not None:
            total = m.aux_loss if total is None else total + m.aux_loss
    return total


class AttachAux(Function):
    """y = x; dx = dy, d aux = c: a pipeline stage's load-balancing loss joins the backward of
    the stage's output, weighted as the loss's backward is (Megatron's MoEAuxLossAutoScaler)."""

    def forward(self, x, aux, c=1.0):
        self.c, self.shape = c, aux.shape
        return x

    def backward(self, g):
        return g, xp.full(self.shape, self.c, dtype=g.dtype)


def stage_aux(layers, out, scale):
    """(out, aux value or None) for a pipeline chunk's ``layers`` after its forward: the sum
    of their MoE layers' aux losses rides on ``out`` (AttachAux, gradient ``scale``)."""
    aux = None
    for f in layers:
        for _, m in moe_layers(f) if isinstance(f, nn.Module) else ():
            if m.aux_loss is not None:
                aux = m.aux_loss if aux is None else aux + m.aux_loss
    if aux is None:
        return out, None
    return AttachAux.apply(out, aux, c=scale), aux.data


def check_moe_config(cfg):
    """The problems of a config's MoE fields (a list of messages; empty: fine)."""
    E, k, c = cfg.n_expert, cfg.expert_top_k, cfg.capacity_factor
    out = []
    if int(E) < 0:
        out.append(f"n_expert must be >= 0 (0: a dense MLP), got {E}")
    elif E and not 1 <= int(k) <= int(E):
        out.append(f"expert_top_k must be in 1..n_expert={E}, got {k}")
    if c is not None and not float(c) > 0:
        out.append(f"capacity_factor must be None (dropless) or > 0, got {c}")
    if not float(cfg.router_aux_loss_coef) >= 0:
        out.append(f"router_aux_loss_coef must be >= 0, got {cfg.router_aux_loss_coef}")
    return out


__all__ = ["MoE", "route", "moe_layers", "moe_stats", "aux_loss", "check_moe_config", "IndexAdd", "Gather",
           "AttachAux", "stage_aux"]
