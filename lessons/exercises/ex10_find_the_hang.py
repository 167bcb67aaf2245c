"""Exercise 10 (8 points): find the hang.

Task. ``buggy_train`` below is data parallelism by hand on a small MLP. It runs fine on
one process. Under ``mpirun -n 4`` it does not: run it and read what the watchdog
says (``PDIST_TIMEOUT=5`` makes it quick)::

    PDIST_TIMEOUT=5 .venv/bin/mpirun -n 4 .venv/bin/python lessons/exercises/ex10_find_the_hang.py

Then write ``fixed_train`` (same arguments): every rank must run the same collectives
in the same order, and it must return each step's loss as the *global-batch* mean
(on every rank), training exactly like one process on the whole batch.

What to read (docs/failures.md). A collective that only some ranks call either hangs
(the others never arrive: ``CollectiveTimeoutError`` and its roll-call say who arrived
and where each missing rank waits instead) or, when the others are in *another*
collective, is caught by the fingerprints (``CollectiveMismatchError``: which field --
op, size, step -- differs on which rank). The step stamp (``comm.set_step``) tells you
which step diverged.

Math. As in exercise 02: the mean of the per-rank mean losses is the global mean
(equal shards), and averaged gradients are the global-batch gradient (Li et al. 2020).

Hints.
* Which rank raised, in which collective, at which step? Is that collective called
  by every rank, every step?
* ``loss.item()`` is this rank's loss, not the global batch's.

Grade: ``python -m pdist.grade 10`` (4 ranks and a sub-group of 2: n = 2 and 4; trained
with SGD, so a summed gradient moves the weights n times too far, and with AdamW).
"""
import numpy as np

from pdist import comm, nn
from pdist.data import shard


def buggy_train(model, opt, group, get_batch, steps):
    """Trains, and logs the averaged loss every other step. Two bugs."""
    losses = []
    for step in range(steps):
        comm.set_step(step)
        x, y = shard(get_batch(step), group.rank, group.size)
        loss = nn.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            group.all_reduce(p.grad, op="avg")
        opt.step()
        opt.zero_grad()
        if group.rank == 0 and step % 2 == 1:            # log the global loss now and then
            v = np.array([loss.item()])
            group.all_reduce(v, op="avg")
            print(f"step {step}: loss {v[0]:.6f}")
        losses.append(loss.item())
    return losses


def fixed_train(model, opt, group, get_batch, steps):
    """buggy_train, fixed: returns the global-batch mean loss of every step, on every rank."""
    raise NotImplementedError("exercise: fix buggy_train")


if __name__ == "__main__":
    from pdist.course import lesson
    from pdist.engine.backend import set_default_dtype
    from pdist.data import regression_batch
    set_default_dtype("float64")
    world = comm.init(timeout=lesson.TIMEOUT)
    rng = np.random.default_rng(5)
    net = nn.Sequential(nn.Linear(6, 16, rng=rng), nn.GELU(), nn.Linear(16, 3, rng=rng))
    out = buggy_train(net, lesson.make_adamw(net.parameters()), world,
                      lambda step: regression_batch(8, 6, 3, 0, step), 4)
    if world.rank == 0:
        print("losses:", out)
