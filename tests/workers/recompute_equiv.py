"""Activation recomputation under one layout: none, selective and full give the same training.

    mpiexec -n 4 python tests/workers/recompute_equiv.py --dp 2 --tp 2 --sp

For each mode, K AdamW steps through ``pdist.training.train`` on a ``parallelize``d
float64 GPT (``GPTConfig(recompute=mode)``), the same batches. Checked on every rank:
the losses, every piece of every parameter and of Adam's m and v in
``sharded_state_dict`` equal the run without recompute (rtol 1e-12), and every
parameter's post-accumulate-grad hook fired once per backward per micro-batch.
Reported: each process group's accounted collectives per mode (calls and bytes by op),
so the test can check ZeRO-3's and DDP's bytes do not change and what tensor
parallelism's full recompute adds. ``--each=A;B;...`` runs several layouts of this world
size in one launch; each report carries ``case``, and an error is re-raised naming it."""
import argparse
import dataclasses

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.testing import each_case, report
from pdist.training import train

p = argparse.ArgumentParser()
for k in ("dp", "tp", "pp", "zero", "microbatches", "steps"):
    p.add_argument(f"--{k}", type=int, default={"microbatches": 1, "steps": 3, "zero": 0}.get(k, 1))
p.add_argument("--sp", action="store_true")
p.add_argument("--schedule", default="1f1b")
p.add_argument("--n-layer", type=int, default=4)
p.add_argument("--each", default=None, help="several layouts, ';'-separated, each run in turn (one launch)")
ARGS = p.parse_args()
set_default_dtype("float64")
world = comm.init()
B, T, SEED = 8, 8, 3
tokens, _ = data.char_dataset(50_000)


def run(args, mode, mesh, groups):
    base = lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=args.n_layer, n_head=4, n_embd=32)
    gpt = GPT(dataclasses.replace(base, recompute=mode), SEED)
    fired = {}
    for n, q in gpt.named_parameters():       # counted before any strategy wraps it
        q.register_post_accumulate_grad_hook(lambda t, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
    model = parallelize(gpt, mesh, zero_stage=args.zero, sequence_parallel=args.sp, schedule=args.schedule,
                        microbatches=args.microbatches)
    opt = AdamW(model.parameters(), lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS,
                weight_decay=lesson.WEIGHT_DECAY)
    for g in groups.values():
        g.reset_stats()
    losses = train(model, opt, data.batch_fn(tokens, B, T, SEED, base.vocab_size), args.steps)
    stats = {a: {op: [s["calls"], s["bytes"]] for op, s in g.stats.items()} for a, g in groups.items()}
    pieces = {k: [to_numpy(s.data).copy() for s in v] for k, v in model.sharded_state_dict(opt).items()}
    return losses, pieces, stats, fired, base


def layout(args, case):
    mesh = comm.DeviceMesh(dp=args.dp, tp=args.tp, pp=args.pp)
    groups = {"dp": mesh.dp_group, "tp": mesh.tp_group, "pp": mesh.pp_group}
    ref_losses, ref_pieces, ref_stats, ref_fired, base = run(args, "none", mesh, groups)
    out = {"none": ref_stats}
    for mode in ("selective", "full"):
        losses, pieces, stats, fired, _ = run(args, mode, mesh, groups)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=0, err_msg=f"{mode}: losses")
        assert sorted(pieces) == sorted(ref_pieces)
        for k, ps in pieces.items():
            for a, b in zip(ps, ref_pieces[k]):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15, err_msg=f"{mode}: {k}")
        assert fired == ref_fired, (mode, fired, ref_fired)
        out[mode] = stats
    report(rank=world.rank, case=case, coords=list(mesh.coords), stats=out, fired=sorted(set(ref_fired.values())),
           steps=args.steps, checked=sum(len(v) for v in ref_pieces.values()), batch=B, seq=T, n_embd=base.n_embd,
           n_layer=base.n_layer)


def main():
    if ARGS.each is None:
        return layout(ARGS, None)
    each_case(ARGS.each, lambda case: layout(p.parse_args(case.split()), case), what="layout")


main()
