"""One process saving a checkpoint, interrupted or held on purpose (tests/test_checkpoint_save.py).

    python tests/workers/ckpt_save_one.py save DIR STEP [--overwrite]
    python tests/workers/ckpt_save_one.py kill-mid-write DIR STEP   # SIGKILL with half the rank file written
    python tests/workers/ckpt_save_one.py kill-between DIR STEP     # DIR exists: overwrite, SIGKILL between
                                                                    # the two renames (no atomic exchange)
    python tests/workers/ckpt_save_one.py hold DIR STEP GO          # holds DIR's lock until the file GO exists

Each prints one report: {"mode", "pid", "error"} (None when saved)."""
import os
import signal
import sys
import time

from pdist import checkpoint
from pdist.checkpoint import owner, writer
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.testing import report

set_default_dtype("float64")
mode, dir, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=1, n_head=2, n_embd=16)
model = GPT(cfg, step)
opt = AdamW(model.parameters())
real = writer.write_safetensors


def half_then_die(path, arrays):
    real(path, arrays)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_go(path, arrays):
    t0 = time.monotonic()
    while not os.path.exists(sys.argv[4]):
        if time.monotonic() - t0 > 60:
            raise TimeoutError(f"{sys.argv[4]} never appeared")
        time.sleep(0.02)
    return real(path, arrays)


if mode == "kill-mid-write":
    writer.write_safetensors = half_then_die
elif mode == "kill-between":
    owner.swap_in.exchange = lambda a, b: False            # the fallback: rename aside, rename in
    owner.swap_in.between_renames = lambda: os.kill(os.getpid(), signal.SIGKILL)
elif mode == "hold":
    writer.write_safetensors = wait_for_go
try:
    checkpoint.save(model, opt, dir, step, overwrite="--overwrite" in sys.argv or mode == "kill-between")
    error = None
except checkpoint.CheckpointError as e:
    error = str(e)
report(mode=mode, pid=os.getpid(), error=error)
