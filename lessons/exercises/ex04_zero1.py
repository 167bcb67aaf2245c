"""Exercise 04 (9 points): ZeRO-1, optimizer state partitioning.

Task. Write ``zero1_step(flat_params, flat_grads, shard, optimizer, group)``, called
after each backward. ``flat_params`` (Psi,) holds every parameter (each model
parameter is a view into it); ``flat_grads`` (Psi,) this rank's gradients (the same
views). ``shard`` is a Tensor holding this rank's slice [a, b) =
``chunk_bounds(Psi, n)[rank]`` of the parameters, and ``optimizer`` (AdamW) updates only
``shard`` -- so Adam's m and v exist only for 1/n of the model on each rank.

Math (Rajbhandari et al. 2020, sec. 5.1, P_os). Instead of an all-reduce (2(n-1)/n*Psi
per rank), reduce-scatter the gradients (each rank gets the average of its slice only:
(n-1)/n*Psi), update the slice, and all-gather the updated parameters ((n-1)/n*Psi):
2(n-1)/n*Psi in all, exactly DDP's traffic, with optimizer memory 8Psi/N instead of 8Psi
(fp32 Adam).

Hints.
* ``group.reduce_scatter(out, inp, op="avg")``: out is this rank's chunk
  (``chunk_bounds(inp.size, n)[rank]``) of the average.
* Set ``shard.grad`` to that chunk, call ``optimizer.step()``, then
  ``group.all_gather(flat_params, shard.data)``.

Grade: ``python -m pdist.grade 04`` (3 ranks on a model of Psi = 4816, so chunks are
uneven; shard.grad = this rank's chunk of the average; equal to single-process training;
bytes 2(n-1)/n*Psi*b, no all-reduce; Adam state = 2 x shard).
"""
from pdist.engine.backend import xp  # noqa: F401
from pdist.comm.algorithms import chunk_bounds  # noqa: F401


def zero1_step(flat_params, flat_grads, shard, optimizer, group):
    """Reduce-scatter the gradients, step this rank's shard, all-gather the parameters."""
    raise NotImplementedError("exercise: ZeRO-1 step")
