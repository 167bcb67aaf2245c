"""A NaN is never trained on silently by default (issue 30, item 4).

    mpiexec -n 2 python tests/workers/defaults_finite.py CASE

CASE ``ddp``: DataParallel with its default check_finite, a NaN weight on rank 1 before step 1:
every rank raises NonFiniteError at step 1. ``ddp_off``: the same with check_finite=False (the
old default): it trains on, the loss NaN everywhere. ``fp16``: fp16 with a NaN weight on rank 1
and GradScaler(max_consecutive_skips=5): every step is skipped, and the 5th in a row raises
NonFiniteError on every rank naming the count and the loss scale.
Each rank reports what it raised (pdist.testing.report)."""
import math
import sys
import time

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine.grad_scaler import GradScaler
from pdist.errors import NonFiniteError
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, Local, parallelize
from pdist.testing import report
from pdist.training import train

case = sys.argv[1]
world = comm.init()
rank = world.rank
tokens, tok = data.char_dataset(20_000)
cfg = lesson.gpt_config(tok.vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=16)
if case == "fp16":
    model = parallelize(GPT(cfg, 0), comm.DeviceMesh(dp=world.size), precision="fp16",
                        scaler=GradScaler(max_consecutive_skips=5, verbose=True))
else:
    model = DataParallel(Local(GPT(cfg, 0), **({"check_finite": False} if case == "ddp_off" else {})))
opt = lesson.make_adamw(model.parameters())
losses = []
t_fault = [None]


def poison(step, loss):
    losses.append(loss)
    if step == 0 and rank == 1:          # before step 1's forward: a NaN weight on rank 1
        model.parameters()[0].data.reshape(-1)[0] = np.nan
        t_fault[0] = time.time()


def batch(step):
    return data.get_batch(tokens, 4, cfg.block_size, 0, step)


try:
    train(model, opt, batch, 10, on_step=poison)
    raised = None
except NonFiniteError as e:
    raised = str(e)
scaler = getattr(model, "scaler", None)
report(rank=rank, case=case, error=raised, steps_done=model.steps,
       last_loss_finite=bool(losses) and math.isfinite(losses[-1]),
       skipped=None if scaler is None else scaler.skipped, t_fault=t_fault[0])
