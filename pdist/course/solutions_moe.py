"""Exercise 12's reference answer (MoE dispatch and combine under expert parallelism; GShard,
Lepikhin et al. 2020, sec. 2-3), re-exported by pdist/course/solutions.py and, like it,
withheld from the student copy (pdist/course/handout.py)."""
import numpy as np

from pdist.engine import functional as F
from pdist.engine.autograd import Function
from pdist.engine.backend import to_numpy, xp
from pdist.engine.ops import mul, sum as tsum
from pdist.engine.shape_ops import concat, reshape, transpose
from pdist.models.moe import Gather, IndexAdd


def sort_by_expert(top, n_expert):
    flat = np.asarray(top).T.reshape(-1)                    # assignment a = j N + n
    return np.argsort(flat, kind="stable"), np.bincount(flat, minlength=n_expert)


class AllToAllV(Function):
    fresh_grads = True

    def forward(self, x, group=None, send=(), recv=()):
        self.group, self.send, self.recv = group, [int(c) for c in send], [int(c) for c in recv]
        y = xp.empty((sum(self.recv),) + x.shape[1:], dtype=x.dtype)
        group.all_to_all_v(y, xp.ascontiguousarray(x), self.send, self.recv)
        return y

    def backward(self, g):
        dx = xp.empty((sum(self.send),) + g.shape[1:], dtype=g.dtype)
        self.group.all_to_all_v(dx, xp.ascontiguousarray(g), self.recv, self.send)
        return dx, None, None, None


def dispatch(xs, counts, group):
    ep = group.size
    mine = np.ascontiguousarray(counts, dtype=np.int64)                # (E,) = (ep * El,)
    theirs = np.empty_like(mine)
    group.all_to_all(theirs, mine)                                     # block q: q's rows for my experts
    src = theirs.reshape(ep, -1)                                       # (ep, El) source x local expert
    send, recv = mine.reshape(ep, -1).sum(1).tolist(), src.sum(1).tolist()
    xr = AllToAllV.apply(xs, group=group, send=send, recv=recv)        # by source, then expert
    start = np.cumsum(np.concatenate([[0], src.reshape(-1)]))[:-1].reshape(src.shape)
    perm = np.concatenate([np.arange(start[q, e], start[q, e] + src[q, e], dtype=np.int64)
                           for e in range(src.shape[1]) for q in range(ep)] + [np.zeros(0, np.int64)])
    xe = Gather.apply(xr, xp.asarray(perm))                            # by local expert, then source
    return xe, [int(c) for c in src.sum(0)], (perm, send, recv)


def combine(ye, plan, group):
    perm, send, recv = plan
    back = Gather.apply(ye, xp.asarray(np.argsort(perm, kind="stable")))    # by source again
    return AllToAllV.apply(back, group=group, send=recv, recv=send)


def moe_forward(layer, x, group):
    N, k = x.shape[0], layer.top_k
    probs = F.softmax(layer.gate(x), axis=-1)                                  # (N, E)
    top = np.argsort(-to_numpy(probs.data), axis=1, kind="stable")[:, :k]      # (N, k)
    w = probs[xp.asarray(np.repeat(np.arange(N)[:, None], k, axis=1)), xp.asarray(top)]
    w = w / tsum(w, axis=1, keepdims=True)                                     # (N, k)
    order, counts = sort_by_expert(top, layer.n_expert)
    tok = xp.asarray(order % N)
    xe, per_expert, plan = dispatch(Gather.apply(x, tok), counts, group)
    outs, a = [], 0
    for e, c in enumerate(per_expert):
        if c:
            outs.append(layer.experts[e](xe[a:a + c]))
        a += c
    ye = concat(outs, axis=0) if len(outs) > 1 else outs[0] if outs else xe * 0.0
    ys = combine(ye, plan, group)                                              # (N k, C) in xs's order
    gate = Gather.apply(reshape(transpose(w, 0, 1), -1), xp.asarray(order))    # w of each assignment
    return IndexAdd.apply(mul(ys, reshape(gate, -1, 1)), tok, n=N)


def reduce_gradients(dense, experts, dp_group, edp_group):
    for params, group, op, scale in ((dense, dp_group, "avg", 1.0), (experts, edp_group, "sum", 1.0 / dp_group.size)):
        for p in params:
            g = p.grad.reshape(-1).copy()
            group.all_reduce(g, op=op)
            p.grad[...] = (g * scale).reshape(p.grad.shape)
