"""Exercise 08 (6 points): the 1F1B pipeline schedule, as data.

Task. Write ``one_f_one_b(p, m)``: for each of the p stages, its program -- a list of
``Instr`` (pdist/parallel/pipeline/schedules.py) -- for one step of m micro-batches. pdist's
schedule checker (``check_schedule``) must accept it and its simulation
(``simulate``; both in pdist/parallel/pipeline/simulate.py) must show the theoretical bubble.

Math (Narayanan et al. 2021, sec. 2.1, PipeDream-flush; GPipe: Huang et al. 2019). Stage
s runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one
backward (F_{w+i}, B_i) while forwards remain, then drains the remaining backwards.
Same bubble as GPipe, (p-1)/(m+p-1) with t_b = 2 t_f, but stage s never holds more
than min(p - s, m) micro-batches of activations (GPipe holds m).

Hints.
* Write the compute *order* of stage s, a list of (FORWARD, mb, 0) and (BACKWARD, mb, 0)
  tuples, and let ``_program(p, s, 1, order)`` add the receives and sends around each
  compute and the final OPTIMIZER_STEP.
* Try ``check_schedule(one_f_one_b(4, 8), 8)`` (returns the peak stash per stage) and
  ``pdist.parallel.pipeline.draw`` to look at it.

Grade: ``python -m pdist.grade 08`` (one process; p = 1..4 with m = 1, 2, p - 1, p,
2p + 1, so m < p and m = p - 1 are covered).
"""
from pdist.parallel.pipeline.schedules import BACKWARD, FORWARD, _program  # noqa: F401


def one_f_one_b(p, m):
    """[program of stage 0, ..., program of stage p-1]."""
    raise NotImplementedError("exercise: the 1F1B schedule")
