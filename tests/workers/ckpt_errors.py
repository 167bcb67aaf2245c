"""Bad checkpoints fail the same way on every rank, before anything is touched.

    mpiexec -n 2 python tests/workers/ckpt_errors.py DIR [DIR ...]

For each directory (the test corrupts copies of a good checkpoint: a truncated file, a
flipped byte, a missing rank file, a config that does not match, an unknown format
version, a directory that is no checkpoint) every rank tries ``checkpoint.load`` into a
dp=2 ZeRO-1 model and reports the error and whether its parameters and optimizer state
are untouched. The last directory is expected to load."""
import sys

import numpy as np

from pdist import checkpoint, comm
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.testing import report

set_default_dtype("float64")
world = comm.init()
cfg = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=2, n_head=4, n_embd=32)
model = parallelize(GPT(cfg, 3), comm.DeviceMesh(dp=world.size), zero_stage=1)
opt = AdamW(model.parameters())


def snapshot():
    return [to_numpy(p.view(p.tensor.data)).copy() for p in model.pieces()]


before = snapshot()
for d in sys.argv[1:]:
    try:
        step, _ = checkpoint.load(model, opt, d)
        error = None
    except checkpoint.CheckpointError as e:
        error, step = str(e), None
    untouched = not opt.state and all(np.array_equal(a, b) for a, b in zip(before, snapshot()))
    report(rank=world.rank, dir=d, error=error, step=step, untouched=untouched)
