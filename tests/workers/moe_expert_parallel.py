"""Expert parallelism against one process, float64, many layouts in one launch.

For each (layout, model, capacity): K AdamW steps under parallelize(model, DeviceMesh(dp=n,
ep=ep)) and, on every rank, one process (Local, microbatches = dp: the same shards, so the
same drops) on the same global batches; full_state_dict is the one process's, and loads
into the layout of another ep. Checked per step: the loss (rtol 1e-9); after K
steps: every parameter this rank holds -- the dense ones, the router, its E/ep experts by
their global names -- and its gradient (rtol 1e-9); the drops summed over dp; the
all_to_all_v bytes of this rank, exactly, from the per-shard expert counts of the
reference: 2 (S + R) C itemsize per MoE layer and step (S: rows this rank sends to other
ep ranks, R: rows it receives), forward and backward. The launch first runs the
all_to_all_v cases of moe_all_to_all_v.py (one launch per world size for both), and at 4
ranks ends with moe_compose.py's cases (ep x ZeRO-1/3, ep x tp, ep x pp); with ``--ckpt save|resume
DIR`` it then runs ckpt_moe.py's phase (MoE and cp checkpoints across layouts)."""
import sys
from pathlib import Path

import numpy as np

from pdist import comm
from pdist.models.gpt import GPT, GPTConfig
from pdist.models.llama import Llama, LlamaConfig
from pdist.models.moe import moe_layers, moe_stats
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.parallel.base import Local
from pdist.testing import report

K, B, T, E = 3, 8, 8, 4


def config(kind, cf):
    kw = dict(vocab_size=32, block_size=T, n_layer=2, n_head=2, n_embd=16, dtype="float64", n_expert=E,
              expert_top_k=2, capacity_factor=cf, router_aux_loss_coef=0.1)
    return (GPT, GPTConfig(**kw)) if kind == "gpt" else (Llama, LlamaConfig(intermediate_size=24, **kw))


def batch(step):
    rng = np.random.default_rng([7, step])
    x = rng.integers(0, 32, (B, T))
    return x, np.roll(x, -1, axis=1)


def reference(M, cfg, dp):
    """One process; returns (losses, {name: (param, grad)}, per-call tokens per expert
    [step][layer][shard], drops)."""
    model = M(cfg, seed=3)
    ref = Local(model, microbatches=dp)
    opt = AdamW(ref.parameters(), lr=1e-2)
    calls = {n: [] for n, _ in moe_layers(model)}
    for name, m in moe_layers(model):
        m.register_forward_hook(lambda mod, a, out, name=name: calls[name].append(mod.stats["tokens"].copy()))
    losses = []
    for step in range(K):
        losses.append(ref.forward_backward(*batch(step)))
        if step < K - 1:
            opt.step()
            opt.zero_grad()
    state = {n: (p.data.copy(), None if p.grad is None else p.grad.copy()) for n, p in model.named_parameters()}
    tokens = {n: np.diff(np.array([np.zeros(E, np.int64)] + c), axis=0).reshape(K, dp, E) for n, c in calls.items()}
    return losses, state, tokens, sum(s["dropped"] for s in moe_stats(model).values())


def expected_bytes(tokens, d, ep, itemsize, C):
    r, g0, El = d % ep, (d // ep) * ep, E // ep
    total = 0
    for tok in tokens.values():                      # (K, dp, E) per layer
        for k in range(K):
            S = tok[k, d].sum() - tok[k, d, r * El:(r + 1) * El].sum()
            R = sum(tok[k, q, r * El:(r + 1) * El].sum() for q in range(g0, g0 + ep) if q != d)
            total += 2 * int(S + R) * C * itemsize
    return total


def one_layout(world, ep, kind, cf):
    n = world.size
    M, cfg = config(kind, cf)
    losses, ref, tokens, ref_drops = reference(M, cfg, n)
    mesh = comm.DeviceMesh(dp=n, ep=ep)
    d = mesh.dp_rank                                  # tp = pp = 1: dp rank = world rank
    assert mesh.ep_rank == d % ep and mesh.edp_group.ranks == list(range(d % ep, n, ep)), mesh.edp_group
    assert ep == 1 or mesh.ep_group.ranks == list(range(d - d % ep, d - d % ep + ep)), mesh.ep_group
    model = parallelize(M(cfg, seed=3), mesh)
    opt = AdamW(model.parameters(), lr=1e-2)
    if mesh.ep_group is not None:
        mesh.ep_group.reset_stats()
    for step in range(K):
        x, y = model.local_batch(*batch(step))
        assert x.shape == (B // n, T), x.shape                # B/dp rows on every rank
        loss = model.forward_backward(x, y)
        assert abs(loss - losses[step]) <= 1e-9 * abs(losses[step]), (ep, kind, cf, step, loss, losses[step])
        if step < K - 1:
            opt.step()
            opt.zero_grad()
    n_expert_params = 0
    for name, p in model.named_parameters():
        gname = getattr(p, "global_name", name)
        want, want_g = ref[gname]
        np.testing.assert_allclose(p.data, want, rtol=1e-9, atol=1e-12, err_msg=f"{ep} {kind} {cf} {gname}")
        assert (p.grad is None) == (want_g is None), (gname, "gradient present on one side only")
        if want_g is not None:
            np.testing.assert_allclose(p.grad, want_g, rtol=1e-9, atol=1e-12, err_msg=f"grad {ep} {kind} {cf} {gname}")
        n_expert_params += ".experts." in gname
    per_expert = 4 if kind == "gpt" else 3
    assert n_expert_params == cfg.n_layer * (E // ep) * per_expert, (ep, n_expert_params)   # E/ep experts here
    drops = sum(s["dropped"] for s in model.moe_stats().values())
    assert drops == ref_drops and (drops > 0) == (cf is not None and drops > 0), (drops, ref_drops)
    got = mesh.ep_group.stats.get("all_to_all_v", {}).get("bytes", 0) if mesh.ep_group else 0
    want = expected_bytes(tokens, mesh.dp_rank, ep, 8, cfg.n_embd) if ep > 1 else 0
    assert got == want, (ep, kind, cf, got, want)
    check_state(world, model, ref, M, cfg, ep)
    return {"ep": ep, "kind": kind, "cf": cf, "drops": drops, "a2a_bytes": got}


def check_state(world, model, ref, M, cfg, ep):
    """full_state_dict gathers every expert (the single-process state dict); loaded into the
    layout of another ep (ep 4 -> 2, 2 -> 4, 2 -> 1, 1 -> 2), each rank holds its experts."""
    full = model.full_state_dict()
    assert list(full) == list(cfg.param_shapes()), sorted(set(full) ^ set(cfg.param_shapes()))
    for name, arr in full.items():
        np.testing.assert_allclose(arr, ref[name][0], rtol=1e-9, atol=1e-12, err_msg=f"full {ep} {name}")
    other = {1: 2, 2: 4 if world.size == 4 else 1, 4: 2}[ep]
    again = parallelize(M(cfg, seed=11), comm.DeviceMesh(dp=world.size, ep=other))
    again.load_full_state_dict(full)
    for name, p in again.named_parameters():
        assert np.array_equal(p.data, full[getattr(p, "global_name", name)]), (ep, other, name)


def uniform_bytes(world, ep):
    """A uniform routing (token n to experts n mod 4 and n+1 mod 4, by a planted gate): one
    MoE layer's forward and backward move 4 all-to-alls of tokens k C (ep - 1)/ep elements."""
    from pdist import Tensor
    N, C, k = 8, 8, 2
    cfg = GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=C, dtype="float64", n_expert=E,
                    expert_top_k=k)
    mesh = comm.DeviceMesh(dp=world.size, ep=ep)
    layer = parallelize(GPT(cfg, seed=0), mesh).module.blocks[0].mlp
    layer.gate.weight.data[...] = np.eye(C, E) + np.eye(C, E, -E)          # feature i -> expert i mod 4
    x = np.zeros((N, C))
    x[np.arange(N), np.arange(N) % E] = 10.0
    x[np.arange(N), E + (np.arange(N) + 1) % E] = 5.0
    mesh.ep_group.reset_stats()
    t = Tensor(x, requires_grad=True)
    layer(t).sum().backward()
    assert layer.stats["tokens"].tolist() == [N * k // E] * E, layer.stats
    got, want = mesh.ep_group.stats["all_to_all_v"]["bytes"], 4 * N * k * C * 8 * (ep - 1) // ep
    assert got == want, (ep, got, want)
    return got


def bad_mesh(world):
    try:
        comm.DeviceMesh(dp=world.size, ep=3)
    except ValueError as e:
        assert "ep=3 must be a positive integer dividing dp" in str(e), e
    else:
        raise AssertionError("DeviceMesh(ep=3) was accepted")


def main():
    """First the all_to_all_v cases (moe_all_to_all_v.py: the same launch), then the layouts."""
    world = comm.init()
    sys.path.insert(0, str(Path(__file__).parent))
    import moe_all_to_all_v as a2av
    cases = a2av.check_group(world)
    a2av.check_errors(world)
    if world.size == 4:
        cases += a2av.check_group(comm.DeviceMesh(dp=2, tp=2).dp_group)
    bad_mesh(world)
    args = sys.argv[1:]
    ckpt = args[args.index("--ckpt") + 1:args.index("--ckpt") + 3] if "--ckpt" in args else None   # phase, dir
    eps = [int(a) for a in (args[:args.index("--ckpt")] if ckpt else args)] or [world.size]
    done = [one_layout(world, ep, kind, cf) for ep in eps for kind, cf in (("gpt", None), ("llama", 1.0))]
    assert any(d["drops"] for d in done if d["cf"]), done
    uniform = [uniform_bytes(world, ep) for ep in eps if ep > 1]
    import moe_compose                   # ep x ZeRO, tp, pp (its 4-rank cases, in this launch)
    compose = moe_compose.run_cases(world) if world.size in moe_compose.CASES else []
    import ckpt_moe                      # checkpoints across ep and cp: "save" at 4 ranks, "resume" at 2
    saved = ckpt_moe.run(world, *ckpt) if ckpt else []
    report(rank=world.rank, n=world.size, done=done, a2a_cases=cases, uniform=uniform, compose=compose,
           ckpt=saved, ok=True)


if __name__ == "__main__":
    main()
