"""``save`` owns only what it wrote: each refusal is the same CheckpointError on every rank.

    mpiexec -n 2 python tests/workers/ckpt_save_cases.py ROOT

ROOT (prepared by tests/test_checkpoint_save.py) holds ``parent/`` (a directory of the
user's: ``step-000100/`` and ``notes.txt``) and ``afile`` (a regular file). A dp 2 ZeRO-1
GPT tries, in order (one report per case and rank: the error, or None):

    parent      save(ROOT/parent): the parent passed by mistake
    file        save(ROOT/afile)
    keep=...    keep=-5, 0, "2", True into ROOT/bad/step-000001
    nan         extra={"loss": nan} into ROOT/nan/step-000001
    old-run     another model (another run) saves ROOT/runs/step-000900
    new-run     this model saves ROOT/runs/step-000100, -000200, -000300 with keep=1, keep=1, keep=2
    exists      this model saves ROOT/runs/step-000300 again without overwrite, then with it (step 301)
    resume      a fresh model loads step-000300 (adopting its run) and saves step-000400 with keep=2
    full-disk   rank 1 may write files of at most 1 kB (RLIMIT_FSIZE): save ROOT/disk/step-000001
                fails; the limit lifted, the same save succeeds
"""
import math
import os
import resource
import signal
import sys

from pdist import checkpoint, comm
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.testing import report
from pdist.training import train
from pdist import data

set_default_dtype("float64")
world = comm.init()
root = sys.argv[1]
cfg = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=1, n_head=2, n_embd=16)
tokens, _ = data.char_dataset(5_000)
batch = data.batch_fn(tokens, 4, 8, 0, cfg.vocab_size)


def build(seed):
    model = parallelize(GPT(cfg, seed), comm.DeviceMesh(dp=world.size), zero_stage=1)
    opt = AdamW(model.parameters())
    train(model, opt, batch, 1)
    return model, opt


def attempt(case, model, opt, dir, step, **kw):
    """One save; the report has its error (or None), and the parent's names and latest() after it."""
    try:
        checkpoint.save(model, opt, os.path.join(root, dir), step, **kw)
        error = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    parent = os.path.dirname(os.path.join(root, dir))
    names = sorted(os.listdir(parent)) if os.path.isdir(parent) else None
    report(case=case, rank=world.rank, error=error, names=names, latest=checkpoint.latest(parent))


model, opt = build(0)
attempt("parent", model, opt, "parent", 100)
attempt("file", model, opt, "afile", 100)
for keep in (-5, 0, "2", True):
    attempt(f"keep={keep!r}", model, opt, "bad/step-000001", 1, keep=keep)
attempt("nan", model, opt, "nan/step-000001", 1, extra={"loss": math.nan})

older, older_opt = build(1)
attempt("old-run", older, older_opt, "runs/step-000900", 900)
for step, keep in ((100, 1), (200, 1), (300, 2)):
    attempt(f"new-run {step}", model, opt, f"runs/step-{step:06d}", step, keep=keep)
attempt("exists", model, opt, "runs/step-000300", 300)
attempt("overwrite", model, opt, "runs/step-000300", 301, overwrite=True)

fresh, fresh_opt = build(2)
checkpoint.load(fresh, fresh_opt, os.path.join(root, "runs/step-000300"))
attempt("resume", fresh, fresh_opt, "runs/step-000400", 400, keep=2)

limit = resource.getrlimit(resource.RLIMIT_FSIZE)
if world.rank == 1:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)           # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
attempt("full-disk", model, opt, "disk/step-000001", 1)
resource.setrlimit(resource.RLIMIT_FSIZE, limit)
attempt("after-full-disk", model, opt, "disk/step-000001", 1)
