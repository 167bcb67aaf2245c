"""Expert parallelism composed with ZeRO-1/2/3, tensor and pipeline parallelism, against one
process, float64, every case of a world size in one launch (pp: 1F1B, and ZB-V: two chunks per
rank and the split backward, under ZeRO-1).

For each case: K AdamW steps under parallelize(model, DeviceMesh(dp, tp, pp, ep), zero_stage,
microbatches) and, on every rank, one process (Local, microbatches = dp m: the same
shards in the same order, so the same routing and drops) on the same global batches. Both
start from one random state (a random router: every expert gets tokens at every step,
checked, so AdamW updates every expert on both sides; under ZeRO an expert no token chose
would take a zero-gradient step where one process skips it). Checked: the loss per step
(rtol 1e-9); B/dp rows per rank; after K steps every piece this rank holds
(``model.pieces()``: dense parameters, the router, its E/ep experts, ZeRO's flat shards cut
into boxes, tp's blocks) and its gradient (rtol 1e-9); the drops; the experts per rank.

    mpiexec -n 4 python tests/workers/moe_compose.py      (or 8: the 8-rank cases)
"""
import numpy as np

from pdist import comm
from pdist.models.gpt import GPT, GPTConfig
from pdist.models.llama import Llama, LlamaConfig
from pdist.models.moe import moe_layers
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.parallel.base import Local
from pdist.parallel.layout import box_slices
from pdist.testing import report

K, B, T, E = 2, 8, 8, 4
CASES = {   # name: (dp, tp, pp, ep, zero_stage, model, capacity, aux, microbatches[, {router, schedule, n_layer,
    #           T, top_k}]); "sparse": 2 tokens a row, top-1: an expert is used in one ep group's micro-batch
    #           and not in the other's (ZeRO-3 keeps experts gathered until the reduction on every edp rank)
    4: [("ep2xdp2-zero1", 4, 1, 1, 2, 1, "gpt", 1.0, 0.1, 1, {"router": "zero"}),
        ("ep2xdp2-zero3", 4, 1, 1, 2, 3, "llama", 1.0, 0.1, 2),
        ("ep2xdp2-zero3-sparse", 4, 1, 1, 2, 3, "gpt", None, 0.1, 2, {"router": "sparse", "T": 2, "top_k": 1}),
        ("ep2xtp2", 2, 2, 1, 2, 0, "gpt", None, 0.1, 1),
        ("ep2xpp2", 2, 1, 2, 2, 0, "llama", None, 0.1, 2),
        ("ep2xpp2-zbv-zero1", 2, 1, 2, 2, 1, "gpt", 1.0, 0.1, 2, {"schedule": "zb-v", "n_layer": 4})],
    8: [("ep2xtp2xdp2-zero2", 4, 2, 1, 2, 2, "llama", 1.0, 0.1, 1)],
}


def config(kind, cf, aux, n_layer=2, top_k=2):
    kw = dict(vocab_size=32, block_size=T, n_layer=n_layer, n_head=2, n_embd=16, dtype="float64", n_expert=E,
              expert_top_k=top_k, capacity_factor=cf, router_aux_loss_coef=aux)
    return (GPT, GPTConfig(**kw)) if kind == "gpt" else (Llama, LlamaConfig(intermediate_size=24, **kw))


def batch(step, t=T):
    rng = np.random.default_rng([5, step])
    x = rng.integers(0, 32, (B, t))
    return x, np.roll(x, -1, axis=1)


def start_state(M, cfg, router="random"):
    """The single-process initial state with a random router (seeded), or a zero one ("zero":
    at step 0 every token picks experts 0 and 1 (ties: the lower index), so experts 2 and 3
    get no gradient and AdamW skips them, on one process and under ZeRO alike)."""
    sd = Local(M(cfg, seed=3)).full_state_dict()
    rng = np.random.default_rng(9)
    for name in sd:
        if name.endswith("mlp.gate.weight"):
            sd[name] = np.zeros(sd[name].shape) if router == "zero" else rng.normal(0.0, 1.0, sd[name].shape)
    return sd


def reference(M, cfg, sd, k, router="random", t=T):
    """One process on the global batches (k micro-batches): losses, {name: (param, grad)}."""
    ref = Local(M(cfg, seed=3), microbatches=k)
    ref.load_full_state_dict(sd)
    opt = AdamW(ref.parameters(), lr=1e-3)
    losses, used = [], []
    for step in range(K):
        losses.append(ref.forward_backward(*batch(step, t)))
        used.append(min(min(m.stats["tokens"]) for _, m in moe_layers(ref.module)))
        for _, m in moe_layers(ref.module):
            m.reset_stats()
        if step < K - 1:
            opt.step()
            opt.zero_grad()
    assert router == "sparse" or (min(used) > 0) == (router == "random"), f"least used expert per step: {used}"
    return losses, {n: (p.data.copy(), None if p.grad is None else p.grad.copy())
                    for n, p in ref.module.named_parameters()}


def one_case(world, name, dp, tp, pp, ep, zero, kind, cf, aux, m, extra=None):
    router, schedule, n_layer, t, top_k = [(extra or {}).get(k, d) for k, d in (
        ("router", "random"), ("schedule", "1f1b"), ("n_layer", 2), ("T", T), ("top_k", 2))]
    M, cfg = config(kind, cf, aux, n_layer, top_k)
    sd = start_state(M, cfg, router)
    losses, ref = reference(M, cfg, sd, dp * m, router, t)
    mesh = comm.DeviceMesh(dp=dp, tp=tp, pp=pp, ep=ep)
    model = parallelize(M(cfg, seed=11), mesh, zero_stage=zero, microbatches=m, schedule=schedule)
    model.load_full_state_dict(sd)
    opt = AdamW(model.parameters(), lr=1e-3)
    for step in range(K):
        x, y = model.local_batch(*batch(step, t))
        assert x.shape == (B // dp, t), (name, x.shape)              # B/dp rows on every rank
        loss = model.forward_backward(x, y)
        assert abs(loss - losses[step]) <= 1e-9 * abs(losses[step]), (name, step, loss, losses[step])
        if step < K - 1:
            opt.step()
            opt.zero_grad()
    experts, names = set(), set()
    for pc in model.pieces():
        want, want_g = ref[pc.name]
        sl = box_slices(pc)
        np.testing.assert_allclose(pc.view(pc.tensor.data), want[sl], rtol=1e-9, atol=1e-12, err_msg=f"{name} {pc}")
        assert (pc.tensor.grad is None) == (want_g is None), (name, pc, "a gradient on one side only")
        if want_g is not None:
            np.testing.assert_allclose(pc.view(pc.tensor.grad), want_g[sl], rtol=1e-9, atol=1e-12,
                                       err_msg=f"{name} grad {pc}")
        names.add(pc.name)
    for n, p in model.module.named_parameters():                     # (ZeRO: pieces are a shard of them)
        gname = getattr(p, "global_name", n)
        if ".experts." in gname:
            experts.add(gname.split(".experts.")[1].split(".")[0])
    assert len(experts) == E // ep, (name, sorted(experts))           # E/ep experts on this rank
    seen = set().union(*world.all_gather_object(sorted(names)))       # every parameter checked somewhere
    assert seen == set(cfg.param_shapes()), (name, sorted(seen ^ set(cfg.param_shapes())))
    drops = sum(s["dropped"] for s in model.moe_stats().values())
    return {"name": name, "pieces": len(names), "drops": drops}


def run_cases(world):
    return [one_case(world, *case) for case in CASES[world.size]]


def main():
    world = comm.init()
    done = run_cases(world)
    report(rank=world.rank, n=world.size, compose=done, ok=True)


if __name__ == "__main__":
    main()
