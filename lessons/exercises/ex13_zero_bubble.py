"""Exercise 13 (4 points): the zero-bubble schedule ZB-H1, as data, from 1F1B.

Task. Write ``zb_h1(p, m)``: for each of the p stages, its program -- a list of ``Instr``
(pdist/parallel/pipeline/instructions.py) -- for one step of m micro-batches, with every
backward split in two: ``BACKWARD_INPUT`` (B: the gradient with respect to the stage's
input, which the previous stage waits for) and ``BACKWARD_WEIGHT`` (W: the weight
gradients, which nobody waits for). pdist's schedule checker (``check_schedule``) must
accept it, its messages must not deadlock (``simulate_rendezvous``), it must hold no more
activations than 1F1B, and its simulation must show ZB-H1's bubble.

Math (Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 3.1).
Take 1F1B's order of forwards and backwards (exercise 08: ``min(p - s - 1, m)`` warm-up
forwards on stage s, then one F and one B in turn, then the remaining B's), with each
backward now a B. Every W can wait: place them to fill the bubble. With t_F = t_B = t_W
1F1B idles (p-1)(t_F + t_B + t_W) per stage and ZB-H1 (p-1)(t_F + t_B - t_W), a third:
the planned bubble is (p-1)/(3m + p-1) for m >= p. A micro-batch's activations are held
from its F until its W (W reads them), so a W that waits holds memory: ZB-H1 keeps
1F1B's peak, min(p, m) micro-batches on any stage.

Hints.
* Write stage s's compute order, a list of (FORWARD, mb, 0), (BACKWARD_INPUT, mb, 0) and
  (BACKWARD_WEIGHT, mb, 0) tuples, and let ``_program(p, s, 1, order)`` add the receives
  and sends (a B sends its gradient right away; a W sends nothing) and the OPTIMIZER_STEP.
* The last stage's cool-down is empty, the first stage's the longest: the later the stage,
  the more W's it can keep back for the end. Count how many idle slots stage s has after
  its last B, and keep that many W's back.
* Try ``check_schedule(zb_h1(4, 8), 8)`` (the peak stash per stage),
  ``simulate(zb_h1(4, 8), t_w=1.0)`` and ``pdist.parallel.pipeline.draw.ascii_timeline``
  (F, I = B, W drawn apart) to look at it.

Grade: ``python -m pdist.grade 13`` (one process; p = 1..4 with m = 1, 2, p - 1, p, 2p + 1).
"""
from pdist.parallel.pipeline.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, _program  # noqa: F401


def zb_h1(p, m):
    """[program of stage 0, ..., program of stage p-1]."""
    raise NotImplementedError("exercise: the ZB-H1 schedule")
