"""Checks of exercise 12 (MoE dispatch and combine over all-to-all; GShard, Lepikhin et al.
2020), run through pdist/course/checks.py at 4 ranks on the ep groups of
``DeviceMesh(dp=4, ep=2)`` and ``DeviceMesh(dp=4, ep=4)``. Each piece is compared with what
pdist computes (its routing, all_to_all_v, its one-process MoE layer, single-process
training), the rows and counts drawn per rank from fixed seeds, so every rank knows what
every other rank sends without a collective of the grader's own."""
import numpy as np

from pdist.course.common import SEED, CheckFailed, close, need

E, K, C, N = 4, 2, 8, 12          # experts, top-k, width, tokens per rank (the layer checks)
STEPS, B = 3, 8                   # the training check: 3 AdamW steps, global batch of 8 rows


def _rows(rank, counts, width=C, salt=0):
    """Rank ``rank``'s rows for each expert: counts[e] rows, seeded by (rank, salt)."""
    return np.random.default_rng([SEED, rank, salt]).standard_normal((int(np.sum(counts)), width))


def _counts(rank):
    """Rank ``rank``'s rows per global expert, 0..3 each, one of them 0."""
    c = np.random.default_rng([SEED, rank, 7]).integers(0, 4, E)
    c[rank % E] = 0
    return c


def _moe_layer(ep_rank, ep):
    """(one process's MoE layer, the same layer holding ep rank ``ep_rank``'s E/ep experts)."""
    from pdist import nn
    from pdist.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=C, dtype="float64", n_expert=E,
                    expert_top_k=K, router_aux_loss_coef=0.0)
    full, local = (GPT(cfg, seed=SEED).blocks[0].mlp for _ in range(2))
    El = E // ep
    local.experts = nn.ModuleList(list(local.experts)[ep_rank * El:(ep_rank + 1) * El])
    return full, local


def _meshes(world):
    from pdist import comm
    need(world.size == 4, f"exercise 12 is graded at 4 ranks, got {world.size}")
    return [comm.DeviceMesh(dp=world.size, ep=ep, world=world) for ep in (2, 4)]


def checks_12(S, world):
    meshes = _meshes(world)

    def each(fn):
        return lambda: [fn(S, m) for m in meshes]

    def training():
        ref_losses, ref_sd, cfg, batch = _reference()
        for m in meshes:
            _train_check(S, m, cfg, batch, ref_losses, ref_sd)

    return [("sort_by_expert: order and counts", lambda: _sort_check(S)),
            ("AllToAllV: forward and backward (uneven counts, zeros)", each(_a2a_check)),
            ("dispatch: rows and counts at ep 2 and 4", each(_dispatched)),
            ("combine: back in the source's order; gradients", each(_combine_check)),
            ("moe_forward: output and gradients equal one process", each(_layer_check)),
            ("reduce_gradients: dense over dp, experts over edp", each(_reduce_check)),
            (f"{STEPS} AdamW steps at ep 2 and ep 4 equal one process", training)]


def _sort_check(S):
    rng = np.random.default_rng(5)
    tops = [np.argsort(rng.random((N, E)), axis=1)[:, :K] for _ in range(3)]
    tops += [np.argsort(rng.random((N, E - 1)), axis=1)[:, :K],                    # the last expert: none
             np.array([[0, 2], [2, 3], [3, 0]])]                                     # expert 1: none
    for top in tops:
        flat = top.T.reshape(-1)
        order, counts = S.sort_by_expert(top.copy(), E)
        counts = np.asarray(counts)
        need(counts.shape == (E,), f"sort_by_expert: counts has shape {counts.shape} for n_expert = {E} "
                                   f"(routing {np.bincount(flat, minlength=E).tolist()} assignments per expert)")
        close(counts, np.bincount(flat, minlength=E), "sort_by_expert: the counts per expert")
        need(np.array_equal(np.asarray(order), np.argsort(flat, kind="stable")),
             f"sort_by_expert: the order of the {flat.size} assignments differs from pdist's (grouped by "
             f"expert; within an expert, a = j N + n ascending)")


def _a2a_check(S, m):
    """The student's AllToAllV on the ep group: uneven counts (zeros too), forward and backward."""
    from pdist.engine.autograd import Tensor
    g = m.ep_group
    M = np.random.default_rng([SEED, g.size, 3]).integers(0, 4, (g.size, g.size))   # M[r, q]: r sends q
    M[0, g.size - 1] = 0
    xt = Tensor(_rows(g.rank, M[g.rank]), requires_grad=True)
    y = S.AllToAllV.apply(xt, group=g, send=M[g.rank].tolist(), recv=M[:, g.rank].tolist())
    want = [np.split(_rows(q, M[q]), np.cumsum(M[q])[:-1])[g.rank] for q in range(g.size)]
    close(y.data, np.concatenate(want), f"ep = {g.size}: AllToAllV's forward (the rows each rank receives)")
    G = _rows(g.rank, M[:, g.rank], salt=1)                                         # dL/dy on this rank
    back = [np.split(_rows(q, M[:, q], salt=1), np.cumsum(M[:, q])[:-1])[g.rank] for q in range(g.size)]
    try:
        (y * Tensor(G)).sum().backward()
    except Exception as e:
        if type(e).__name__ == "CollectiveTimeoutError":
            raise
        raise CheckFailed(f"ep = {g.size}: AllToAllV's backward: {type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0]}", detail=str(e)) from None
    close(xt.grad, np.concatenate(back), f"ep = {g.size}: AllToAllV's backward (dL/dx, the rows sent back)")


def _dispatched(S, m):
    """The student's dispatch of this rank's rows: what it receives and each local expert's count."""
    from pdist.engine.autograd import Tensor
    g, El = m.ep_group, E // m.ep_group.size
    base = m.dp_rank - g.rank                                   # the ep group: dp ranks base .. base + ep - 1
    counts = _counts(m.dp_rank)
    xs = Tensor(_rows(m.dp_rank, counts), requires_grad=True)
    xe, per_expert, plan = S.dispatch(xs, counts.copy(), g)
    mine = [g.rank * El + e for e in range(El)]
    blocks = {q: np.split(_rows(base + q, _counts(base + q)), np.cumsum(_counts(base + q))[:-1])
              for q in range(g.size)}
    want = [blocks[q][e] for e in mine for q in range(g.size)]
    need([int(c) for c in per_expert] == [sum(int(_counts(base + q)[e]) for q in range(g.size)) for e in mine],
         f"ep = {g.size}: dispatch: the row count of each local expert (per_expert) differs from pdist's")
    close(xe.data, np.concatenate(want), f"ep = {g.size}: dispatch: the rows this rank receives (by local "
                                         f"expert, then source rank)")
    return g, counts, xs, xe, per_expert, plan, mine


def _combine_check(S, m):
    """combine of the dispatched rows, each local expert e scaling its rows by e + 1."""
    from pdist.engine.autograd import Tensor
    g, counts, xs, xe, per_expert, plan, mine = _dispatched(S, m)
    f = np.repeat(np.array(mine, dtype=np.float64) + 1, [int(c) for c in per_expert])[:, None]
    ys = S.combine(xe * Tensor(f), plan, g)
    scale = (np.repeat(np.arange(E), counts) + 1.0)[:, None]
    close(ys.data, xs.data * scale, f"ep = {g.size}: combine: row i of the result is the output for xs's row i")
    R = _rows(m.dp_rank, counts, salt=2)
    (ys * Tensor(R)).sum().backward()
    close(xs.grad, R * scale, f"ep = {g.size}: dL/dxs through combine and dispatch")


def _grads(module):
    return {n: np.zeros(p.shape) if p.grad is None else np.array(p.grad) for n, p in module.named_parameters()}


def _layer_check(S, m):
    """moe_forward on this rank's N tokens equals one process's layer: y, dx, the router's
    gradient, and each local expert's gradient = the sum over the ep group's ranks."""
    from pdist.engine.autograd import Tensor
    g, El = m.ep_group, E // m.ep_group.size
    full, local = _moe_layer(g.rank, g.size)
    x, R = (np.random.default_rng([SEED, m.dp_rank, s]).standard_normal((N, C)) for s in (4, 5))
    xt, xr = Tensor(x.copy(), requires_grad=True), Tensor(x.copy(), requires_grad=True)
    y = S.moe_forward(local, xt, g)
    (y * Tensor(R)).sum().backward()
    yr = full(xr)
    (yr * Tensor(R)).sum().backward()
    close(y.data, yr.data, f"ep = {g.size}: moe_forward: the layer's output y")
    close(xt.grad, xr.grad, f"ep = {g.size}: moe_forward: dL/dx")
    close(_grads(local.gate)["weight"], _grads(full.gate)["weight"], f"ep = {g.size}: the router's gradient")
    ref = _grads(full.experts)
    flat = np.concatenate([ref[n].reshape(-1) for n in ref])
    g.all_reduce(flat)                                                 # each expert: the sum over the ep group
    a = 0
    for n in ref:
        ref[n], a = flat[a:a + ref[n].size].reshape(ref[n].shape), a + ref[n].size
    for n, got in _grads(local.experts).items():
        i, rest = n.split(".", 1)
        gname = f"{g.rank * El + int(i)}.{rest}"
        close(got, ref[gname], f"ep = {g.size}: expert {gname}'s gradient (the sum over the ep group's tokens)")


def _reduce_check(S, m):
    from pdist.engine.autograd import Tensor
    dp, ep = m.dp_group.size, m.ep_world_size
    shapes = [(3, 2), (5,)]

    def grad(rank, i, kind):
        return np.random.default_rng([SEED, rank, i, kind]).standard_normal(shapes[i])

    params = {}
    for kind in (0, 1):
        params[kind] = [Tensor(np.zeros(s), requires_grad=True) for s in shapes]
        for i, p in enumerate(params[kind]):
            p.grad = grad(m.dp_rank, i, kind)
    S.reduce_gradients(params[0], params[1], m.dp_group, m.edp_group)
    for i, p in enumerate(params[0]):
        close(p.grad, np.mean([grad(r, i, 0) for r in range(dp)], axis=0),
              f"ep = {ep}: after reduce_gradients, dense parameter {i}'s gradient")
    for i, p in enumerate(params[1]):
        want = np.sum([grad(r, i, 1) for r in range(dp) if r % ep == m.ep_rank], axis=0) / dp
        close(p.grad, want, f"ep = {ep}: after reduce_gradients, expert parameter {i}'s gradient")


def _reference():
    from pdist import data
    from pdist.course import lesson
    from pdist.models.gpt import GPT, GPTConfig
    from pdist.parallel.base import Local
    from pdist.training import train
    tokens, tok = data.char_dataset(20_000)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=16, dtype="float64",
                    n_expert=E, expert_top_k=K, router_aux_loss_coef=0.0)      # (moe_forward has no aux loss)
    batch = data.batch_fn(tokens, B, cfg.block_size, SEED)
    model = Local(GPT(cfg, seed=SEED), microbatches=4)
    losses = train(model, lesson.make_adamw(model.parameters()), batch, STEPS)
    return losses, model.module.state_dict(), cfg, batch


def _train_check(S, m, cfg, batch, ref_losses, ref_sd):
    """The student's layer and gradient sync in a small MoE GPT, trained on this rank's shard."""
    from pdist import nn
    from pdist.course import lesson
    from pdist.data import shard
    from pdist.engine.shape_ops import reshape
    from pdist.models.gpt import GPT
    from pdist.models.moe import moe_layers
    model, ep, r = GPT(cfg, seed=SEED), m.ep_world_size, m.ep_rank
    names, El = {id(p): n for n, p in model.named_parameters()}, E // ep
    for _, lay in moe_layers(model):
        lay.experts = nn.ModuleList(list(lay.experts)[r * El:(r + 1) * El])
        lay.forward = lambda x, lay=lay: reshape(S.moe_forward(lay, reshape(x, -1, x.shape[-1]), m.ep_group),
                                                 *x.shape)
    params = [p for _, p in model.named_parameters()]
    experts = [p for p in params if ".experts." in names[id(p)]]
    dense = [p for p in params if ".experts." not in names[id(p)]]
    opt, losses = lesson.make_adamw(params), []
    for step in range(STEPS):
        x, y = shard(batch(step), m.dp_rank, m.dp_world_size)
        loss = model(x, y)[1]
        loss.backward()
        for p in params:
            if p.grad is None:                      # an expert no token of this group chose
                p.grad = np.zeros(p.shape)
        S.reduce_gradients(dense, experts, m.dp_group, m.edp_group)
        v = np.array([float(loss.data)])
        m.dp_group.all_reduce(v, op="avg")
        losses.append(float(v[0]))
        opt.step()
        opt.zero_grad(set_to_none=False)
    close(losses, ref_losses, f"ep = {ep}: the loss per step")
    for p in params:
        close(p.data, ref_sd[names[id(p)]], f"ep = {ep}: after {STEPS} steps, {names[id(p)]}")
