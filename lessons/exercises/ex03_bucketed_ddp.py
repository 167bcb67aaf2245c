"""Exercise 03 (10 points): bucketed DDP with overlap.

Task. PyTorch DDP's design in three functions; the grader's ``HandDDP`` (a pdist
strategy) calls them:

* ``make_buckets(params, cap_bytes)``: group the parameters into buckets (lists).
* ``on_grad_ready(ddp, p)``: the post-accumulate-grad hook, called when backward has
  finished p's gradient. Issue buckets that are complete.
* ``finish_grad_sync(ddp)``: after backward: issue what is left, wait for everything,
  reset for the next step.

``ddp`` has ``ddp.group``, ``ddp.buckets`` (each ``b.params``, ``b.buffer`` -- one flat
array that every ``p.grad`` of the bucket is a view into --, ``b.ready`` (an empty set
to fill with ``id(p)``), ``b.work``), ``ddp.bucket_of[id(p)]`` and ``ddp.next`` (the
index of the next bucket to issue; starts at 0).

Math (Li et al. 2020, sec. 3.2). One all-reduce per bucket instead of per parameter:
the same 2(n-1)/n*Psi*b bytes, far fewer latencies (alpha). Backward produces
gradients roughly in reverse registration order, so build buckets walking the
parameters *in reverse*, closing a bucket when adding the next parameter would pass
the cap (a bucket may hold exactly the cap; a bigger parameter gets a bucket of its
own, and no bucket is empty). Every rank must issue the
same all-reduces in the same order: issue bucket i only after bucket i-1, even if i
is complete first.

Hints.
* ``b.work = ddp.group.all_reduce(b.buffer, op="avg", async_op=True)`` returns at once;
  ``b.work.wait()`` later. That is the overlap: communication runs while backward
  computes the earlier layers.
* A bucket is complete when ``len(b.ready) == len(b.params)``.
* After the waits: ``b.work = None``, ``b.ready.clear()``, ``ddp.next = 0``.

Grade: ``python -m pdist.grade 03`` (3 ranks and a sub-group of 2; buckets = DDP's at
several caps, some met exactly, some smaller than a parameter; the averaged gradient;
buckets issued in order, each once, ``ddp.next`` advanced; every Work waited on and the
buckets reset; equal to single-process training; buckets issued during backward; one
all-reduce per bucket).
"""


def make_buckets(params, cap_bytes):
    """[[params of bucket 0], [bucket 1], ...], bucket 0 holding the last parameters."""
    raise NotImplementedError("exercise: build the buckets (reverse order, cap in bytes)")


def on_grad_ready(ddp, p):
    """Mark p ready; issue, in order, every bucket that is now complete."""
    raise NotImplementedError("exercise: the hook that issues complete buckets")


def finish_grad_sync(ddp):
    """Issue the buckets not issued yet, wait for all, reset for the next step."""
    raise NotImplementedError("exercise: finish the gradient synchronization")
