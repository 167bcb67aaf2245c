"""Exercise 09 (8 points): resharding -- which saved slices a new shard needs.

Task. A checkpoint saves each tensor as boxes: pieces with ``offsets`` (per axis) and
``shape`` (docs/checkpoint.md). A new layout (another world size, TP instead of ZeRO)
wants one box of the tensor: ``offsets`` and ``shape``. Write
``plan_reads(saved, offsets, shape)``: for every saved box that overlaps the target,
``(i, src, dst)``, where ``i`` is its index in ``saved``, ``src`` a tuple of slices into
that saved box and ``dst`` a tuple of slices into the target, such that

    target[dst] = saved_box_i[src]    for each entry fills the target exactly.

Math. Boxes are products of half-open intervals. Per axis the intersection of
[o, o + s) and [a, a + k) is [max(o, a), min(o + s, a + k)); the boxes overlap iff it
is non-empty on every axis. Its slices are relative to each box's own origin. This is
what pdist's checkpoint reader does (``Reader.read_box`` in pdist/checkpoint/format.py)
so that any layout can load what any layout saved.

Hints.
* ``saved`` is a list of dicts ``{"offsets": [...], "shape": [...]}``.
* Skip boxes whose intersection is empty on some axis (don't return empty reads).

Grade: ``python -m pdist.grade 09`` (one process; flat ZeRO boxes, TP blocks, random
targets).
"""


def plan_reads(saved, offsets, shape):
    """[(index of the saved box, src slices, dst slices)] for every overlapping saved box."""
    raise NotImplementedError("exercise: intersect the target box with the saved boxes")
