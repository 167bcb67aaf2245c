"""A rank that skips a training step is caught, never averaged silently (issue 11).

``--case one``: rank 1 skips step 2 of the loop. ``--case two``: rank 0 skips step 1 and
rank 1 skips step 2 (before step stamps, this ran to the end with bit-identical replicas
that differ from correct training). Each rank steps through the data with
``forward_backward(x, y, step=step)``, as pdist.training.train does; every rank must
raise CollectiveMismatchError naming the steps, and reports it (pdist.testing.report)."""
import sys

from pdist import comm, data
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.comm import CollectiveMismatchError
from pdist.models.gpt import GPT
from pdist.parallel import parallelize
from pdist.testing import report

set_default_dtype("float64")
case, zero = sys.argv[1], int(sys.argv[2])
world = comm.init(timeout=30)
n, rank = world.size, world.rank
skip = {"one": {1: 2}, "two": {0: 1, 1: 2}}[case]
tokens, tok = data.char_dataset(50_000)
cfg = lesson.gpt_config(tok.vocab_size, dtype="float64", block_size=8, n_layer=2, n_head=4, n_embd=32)
model = parallelize(GPT(cfg, 0), comm.DeviceMesh(dp=n), zero_stage=zero)
opt = lesson.make_adamw(model.parameters())
error, done = None, []
try:
    for step in range(5):
        if skip.get(rank) == step:
            continue                                    # this rank skips the step (a bug in its loop)
        x, y = model.local_batch(*data.get_batch(tokens, 2 * n, cfg.block_size, 0, step))
        model.forward_backward(x, y, step=step)
        opt.step()
        opt.zero_grad()
        done.append(step)
except CollectiveMismatchError as e:
    error = str(e)
report(rank=rank, error=error, done=done)
