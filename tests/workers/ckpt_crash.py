"""A rank dies in the middle of ``save``: the previous checkpoint stays whole.

    mpiexec -n 2 python tests/workers/ckpt_crash.py DIR

Saves DIR at step 1, trains a step, then overwrites DIR (step 2) with the last rank
killed (SIGKILL) after writing half of its rank file. The test then checks that
DIR still verifies and holds step 1 (run with ``launch(..., wrap=False)``)."""
import os
import signal
import sys

from pdist import checkpoint, comm, data
from pdist.checkpoint import format as checkpoint_format, writer
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.testing import report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
d = sys.argv[1]
tokens, _ = data.char_dataset(20_000)
cfg = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=2, n_head=4, n_embd=32)
model = parallelize(GPT(cfg, 3), comm.DeviceMesh(dp=world.size), zero_stage=2)
opt = AdamW(model.parameters())

batch = data.batch_fn(tokens, 8, 8, 3, cfg.vocab_size)


train(model, opt, batch, 1)
checkpoint.save(model, opt, d, 1)
train(model, opt, batch, 1, start=1)
report(rank=world.rank, saved=1)
real = checkpoint_format.write_safetensors


def dying_write(path, arrays):
    if world.rank == world.size - 1:
        real(path, arrays)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)   # killed mid-write: half a file, no cleanup at all
    return real(path, arrays)


writer.write_safetensors = dying_write   # what save() calls
checkpoint.save(model, opt, d, 2, overwrite=True)
report(rank=world.rank, saved=2)     # never reached on the dying rank; the others are stopped
