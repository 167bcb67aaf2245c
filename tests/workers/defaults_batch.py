"""Ranks handed different global batches are caught at step 0 (issue 30, item 3).

    mpiexec -n 2 python tests/workers/defaults_batch.py LAYOUT LOADER [off]

LAYOUT: dp, tp, pp or dp_fp16 (a mesh of 2 ranks); LOADER: "rank" (seeded by the rank, as
PyTorch DDP code often is) or "step" (pdist's get_batch, the same on every rank). ``off``:
``model.check_batch = False`` (the check switched off: the run trains, silently wrong).
Each rank reports what it raised and how many steps it finished (pdist.testing.report)."""
import sys
import time

from pdist import comm, data
from pdist.comm.check import BatchMismatchError
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.parallel import parallelize
from pdist.testing import report
from pdist.training import train

layout, loader = sys.argv[1], sys.argv[2]
off = "off" in sys.argv[3:]
set_default_dtype("float32")
world = comm.init()
rank = world.rank
tokens, tok = data.char_dataset(20_000)
cfg = lesson.gpt_config(96, block_size=8, n_layer=2, n_head=4, n_embd=32)
kind = layout.split("_")[0]
mesh = comm.DeviceMesh(**{kind: world.size})
extra = {"microbatches": 2} if kind == "pp" else {}
model = parallelize(GPT(cfg, 0), mesh, precision="fp16" if layout.endswith("fp16") else "fp32", **extra)
if off:
    model.check_batch = False
opt = lesson.make_adamw(model.parameters())


def batch(step):
    seed = rank if loader == "rank" else 0
    return data.get_batch(tokens, 8, cfg.block_size, seed, step)


t_fault = time.time()            # the fault: step 0's batch (bench/defaults.py times detection from here)
try:
    train(model, opt, batch, 3)
    raised = None
except BatchMismatchError as e:
    raised = str(e)
report(rank=rank, layout=layout, loader=loader, error=raised, steps_done=model.steps, t_fault=t_fault)
