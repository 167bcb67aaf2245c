"""Non-finite values are never trained on silently (issue 11).

* A NaN weight on one rank (rank n-1, at step 2) under ``check_finite=True``: every rank
  raises NonFiniteError at step 2, naming that rank's loss (DDP, ZeRO-1, ZeRO-3).
* An inf gradient on one rank, then ``clip_grad_norm_(..., error_if_nonfinite=True)``:
  every rank raises NonFiniteError, and no gradient was modified.
Each rank reports what it raised (pdist.testing.report)."""
import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.errors import NonFiniteError
from pdist.models.gpt import GPT
from pdist.optim import clip_grad_norm_
from pdist.parallel import DataParallel, Local, parallelize
from pdist.testing import report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
n, rank = world.size, world.rank
tokens, tok = data.char_dataset(50_000)
cfg = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=8, n_layer=2, n_head=4, n_embd=32)
BAD_STEP, BAD_RANK = 2, n - 1


def batch(step):
    return data.get_batch(tokens, 4 * n, cfg.block_size, 0, step)


def poison(step, loss):
    if step + 1 == BAD_STEP and rank == BAD_RANK:       # before step BAD_STEP's forward: a NaN weight
        model.parameters()[-1].data.reshape(-1)[-1] = np.nan


for zero in (0, 1, 3):
    model = parallelize(GPT(cfg, 0), comm.DeviceMesh(dp=n), zero_stage=zero, check_finite=True)
    opt = lesson.make_adamw(model.parameters())
    try:
        train(model, opt, batch, 4, on_step=poison)
        raised = None
    except NonFiniteError as e:
        raised = str(e)
    report(case=f"nan weight zero={zero}", rank=rank, error=raised, steps_done=model.steps)

model = DataParallel(Local(GPT(cfg, 0), check_finite=False))   # clip_grad_norm_ must see the inf itself
if rank == BAD_RANK:         # backward produces an inf on this rank; the all-reduce spreads it
    model.parameters()[0].register_hook(lambda g: g * np.inf)
model.forward_backward(*model.local_batch(*batch(0)))
before = [p.grad.copy() for p in model.parameters()]
try:
    clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    raised = None
except NonFiniteError as e:
    raised = str(e)
untouched = all(np.array_equal(a, p.grad) for a, p in zip(before, model.parameters()))
report(case="inf grad clip", rank=rank, error=raised, untouched=untouched)
