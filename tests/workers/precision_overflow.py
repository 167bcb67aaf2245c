"""fp16 under data parallelism / ZeRO: an overflow on ONE rank skips the step on EVERY rank.

    mpiexec -n 4 python tests/workers/precision_overflow.py --zero 2
    mpiexec -n 4 python tests/workers/precision_overflow.py --pp 2      # dp 2 x pp 2, 1F1B, m = 2

At step 1 the last rank's gradient of one small parameter (the last LayerNorm's bias,
which lies in one rank's shard at stages 2, 3) becomes inf before the reduction. The
found-inf verdict is the [loss, #non-finite] all-reduce of every wrapper, so every rank
must skip the step (masters and Adam's state unchanged), halve the scale (2^10 -> 2^9)
and go on training at step 2; with growth_interval 2 the scale doubles again after
steps 2 and 3; nothing raises. With ``--pp`` the last rank is the pipeline's last stage
(the only one holding ln_f): the stages before it see finite gradients and must skip too.
Reported per rank for the test to compare. ``--each=A;B`` runs several cases of this world
size in one launch; each report carries ``case``, and an error is re-raised naming it."""
import argparse

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine.grad_scaler import GradScaler
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.testing import each_case, report

p = argparse.ArgumentParser()
p.add_argument("--zero", type=int, default=0)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--each", default=None, help="several cases, ';'-separated, each run in turn (one launch)")
ARGS = p.parse_args()
world = comm.init()
tokens, tok = data.char_dataset(50_000)
cfg = lesson.gpt_config(96, block_size=8, n_layer=2, n_head=4, n_embd=32)


def run(args, case):
    mesh = comm.DeviceMesh(dp=world.size // args.pp, pp=args.pp)
    model = parallelize(GPT(cfg, 3), mesh, zero_stage=args.zero, precision="fp16", microbatches=2 if args.pp > 1 else 1,
                        scaler=GradScaler(init_scale=2.0 ** 10, growth_interval=2))
    opt = AdamW(model.parameters(), lr=lesson.LR)
    poison = [False]
    bias = dict(model.module.named_parameters()).get("transformer.ln_f.bias")
    if world.rank == world.size - 1:
        bias.register_hook(lambda g: g * np.inf if poison[0] else None)

    def masters():
        return np.concatenate([m.data.ravel() for m in model.parameters()])

    log = []
    for step in range(4):
        x, y = data.get_batch(tokens, 8, 8, 3, step)
        poison[0] = step == 1
        before, adam_steps = masters(), sorted({s["step"] for s in opt.state.values()})
        scale = model.scaler.get_scale()
        loss = model.forward_backward(*model.local_batch(x % 96, y % 96), step=step)
        opt.step()
        opt.zero_grad(set_to_none=False)
        log.append({"step": step, "scale_used": scale, "scale_next": model.scaler.get_scale(),
                    "changed": bool(not np.array_equal(before, masters())), "adam_steps_before": adam_steps,
                    "loss_finite": bool(np.isfinite(loss))})
    report(rank=world.rank, case=case, log=log)


def main():
    if ARGS.each is None:
        return run(ARGS, None)
    each_case(ARGS.each, lambda case: run(p.parse_args(case.split()), case), what="case")


main()
