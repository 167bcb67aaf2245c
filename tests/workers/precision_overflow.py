"""fp16 under data parallelism / ZeRO: an overflow on ONE rank skips the step on EVERY rank.

    mpiexec -n 4 python tests/workers/precision_overflow.py --zero 2

At step 1 the last rank's gradient of one small parameter (the last LayerNorm's bias,
which lies in one rank's shard at stages 2, 3) becomes inf before the reduction. The
found-inf verdict is the [loss, #non-finite] all-reduce of every wrapper, so every rank
must skip the step (masters and Adam's state unchanged), halve the scale (2^10 -> 2^9)
and go on training at step 2; with growth_interval 2 the scale doubles again after
steps 2 and 3; nothing raises. Reported per rank for the test to compare."""
import argparse

import numpy as np

from pdist import comm, data, lesson
from pdist.grad_scaler import GradScaler
from pdist.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.testing import report

p = argparse.ArgumentParser()
p.add_argument("--zero", type=int, default=0)
args = p.parse_args()
world = comm.init()
tokens, tok = data.char_dataset(50_000)
cfg = lesson.gpt_config(96, block_size=8, n_layer=2, n_head=4, n_embd=32)
model = parallelize(GPT(cfg, 3), comm.DeviceMesh(dp=world.size), zero_stage=args.zero, precision="fp16",
                    scaler=GradScaler(init_scale=2.0 ** 10, growth_interval=2))
opt = AdamW(model.parameters(), lr=lesson.LR)
poison = [False]
bias = dict(model.module.named_parameters())["transformer.ln_f.bias"]
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
report(rank=world.rank, log=log)
