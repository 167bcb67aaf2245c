"""The one training loop: every layout, every strategy, every lesson.

    losses = train(model, optimizer, get_batch, steps)

``model`` is anything of the one shape (pdist.parallel: ``parallelize(...)``,
``DataParallel(...)``, ``ZeRO(...)``, ..., or ``Local(GPT(...))`` for one process);
``get_batch(step) -> (x, y)`` gives the step's *global* batch, the same on every
rank (``data.get_batch(tokens, B, T, seed, step)``): the model cuts out this rank's
rows. Each step: the rows, forward and backward (gradients synchronized), the
optimizer step, gradients zeroed in place (``set_to_none=False``: their buffers stay,
so memory measured between steps holds the gradients the ZeRO formulas count). Returns the loss of every step, the mean over the
global batch, on every rank. ``on_step(step, loss)`` runs after each step (timing,
checks, printing).
"""


def train(model, optimizer, get_batch, steps, on_step=None, start=0):
    losses = []
    for step in range(start, start + steps):
        x, y = model.local_batch(*get_batch(step))
        loss = model.forward_backward(x, y, step=step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return losses


__all__ = ["train"]
