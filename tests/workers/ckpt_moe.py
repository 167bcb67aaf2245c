"""Checkpoints reshard across ep and cp (tests/test_expert_parallel.py runs ``run`` inside its
4- and 2-rank launches), float64.

    mpiexec -n 4 python tests/workers/ckpt_moe.py save DIR      ep 4 (dp 4) MoE, cp 2 x dp 2 dense
    mpiexec -n 2 python tests/workers/ckpt_moe.py resume DIR    ep 2 (+ ZeRO-1), cp 1, one process

Every layout starts from one state and trains on the same global batches; the MoE runs
always route the same calls (B/4 rows: dp 4; dp 2 x 2 micro-batches; one process x 4), so
capacity drops and the load-balancing loss are those of the uninterrupted run. ``save``:
k AdamW steps, a checkpoint, then K - k more, checked against one process (the
uninterrupted run). ``resume``: each layout loads the checkpoint (the experts E/ep per rank
out of ep 4's files, ZeRO's edp shards, a cp 2 checkpoint at cp 1), trains K - k steps and
must equal the uninterrupted run: every piece of every parameter and of AdamW's m and v
(every expert, the router), Adam's step, the loss per step, rtol 1e-9."""
import sys
from pathlib import Path

import numpy as np

from pdist import checkpoint, comm
from pdist.models.gpt import GPT, GPTConfig
from pdist.optim import AdamW
from pdist.parallel import Local, parallelize
from pdist.parallel.layout import box_slices
from pdist.testing import report

sys.path.insert(0, str(Path(__file__).parent))
import moe_compose as mc                     # noqa: E402  (its config, batches, random router)

k, K, CALLS = 1, 2, 4


def dense():
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="float64")
    return GPT, cfg, Local(GPT(cfg, seed=3)).full_state_dict()


def moe():
    M, cfg = mc.config("llama", 1.0, 0.1)
    return M, cfg, mc.start_state(M, cfg)


def uninterrupted(M, cfg, sd, calls):
    """One process, K steps: (losses, {name: param}, {name: (exp_avg, exp_avg_sq, step)})."""
    ref = Local(M(cfg, seed=3), microbatches=calls)
    ref.load_full_state_dict(sd)
    opt = AdamW(ref.parameters(), lr=1e-3)
    losses = []
    for step in range(K):
        losses.append(ref.forward_backward(*mc.batch(step)))
        opt.step()
        opt.zero_grad()
    named = list(ref.module.named_parameters())
    return losses, {n: p.data.copy() for n, p in named}, \
        {n: (opt.state[id(p)]["exp_avg"], opt.state[id(p)]["exp_avg_sq"], opt.state[id(p)]["step"]) for n, p in named}


def train(model, opt, steps, losses, what):
    for step in steps:
        loss = model.forward_backward(*model.local_batch(*mc.batch(step)))
        assert abs(loss - losses[step]) <= 1e-9 * abs(losses[step]), (what, step, loss, losses[step])
        opt.step()
        opt.zero_grad()


def check(model, opt, ref, what):
    """Every piece of every parameter and of AdamW's state on this rank against one process."""
    _, params, states = ref
    n = 0
    for pc in model.pieces():
        sl = box_slices(pc)
        np.testing.assert_allclose(pc.view(pc.tensor.data), params[pc.name][sl], rtol=1e-9, atol=1e-12,
                                   err_msg=f"{what} {pc}")
        st = opt.state[id(pc.tensor)]
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            np.testing.assert_allclose(pc.view(st[key]), states[pc.name][i][sl], rtol=1e-9, atol=1e-15,
                                       err_msg=f"{what} {key} {pc}")
        assert st["step"] == states[pc.name][2] == K, (what, pc, st["step"])
        n += 1
    return n


def build(M, cfg, layout):
    kind, kw = layout
    if kind == "local":
        return Local(M(cfg, seed=11), microbatches=kw.get("mb", 1))
    mesh = comm.DeviceMesh(dp=kw["dp"], ep=kw.get("ep", 1), cp=kw.get("cp", 1))
    return parallelize(M(cfg, seed=11), mesh, zero_stage=kw.get("zero", 0), microbatches=kw.get("mb", 1),
                       context_parallel=kw.get("context"))


SAVE = {"moe": ("mesh", dict(dp=4, ep=4)), "cp": ("mesh", dict(dp=2, cp=2, context="ring"))}
RESUME = {"moe": [("mesh", dict(dp=2, ep=2, mb=2)), ("mesh", dict(dp=2, ep=2, mb=2, zero=1)),
                  ("local", dict(mb=4))],
          "cp": [("mesh", dict(dp=2)), ("local", {})]}


def run(world, phase, root):
    """``phase`` ("save": at 4 ranks, "resume": at 2) under ``root``; [{case, pieces}]."""
    root, out = Path(root), []
    for name, (M, cfg, sd) in (("moe", moe()), ("cp", dense())):
        calls = CALLS if name == "moe" else 1
        ref = uninterrupted(M, cfg, sd, calls)
        for layout in ([SAVE[name]] if phase == "save" else RESUME[name]):
            what = f"{name} {layout}"
            model = build(M, cfg, layout)
            opt = AdamW(model.parameters(), lr=1e-3)
            if phase == "save":
                model.load_full_state_dict(sd)
                train(model, opt, range(k), ref[0], what)
                checkpoint.save(model, opt, root / name, step=k)
            else:
                step, _ = checkpoint.load(model, opt, root / name)
                assert step == k, (what, step)
            train(model, opt, range(k, K), ref[0], what)
            out.append({"case": what, "pieces": check(model, opt, ref, what)})
    return out


def main():
    world = comm.init()
    report(rank=world.rank, n=world.size, phase=sys.argv[1], cases=run(world, *sys.argv[1:3]), ok=True)


if __name__ == "__main__":
    main()
