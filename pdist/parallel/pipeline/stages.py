"""A model cut into pipeline stages, as its plan says (``ModelPlan.pipeline``, pdist/models/plan.py).

    f = f_{V-1} o ... o f_1 o f_0           virtual stage k = chunk c of rank s, k = c p + s
                                            (V-shaped schedules: k = s for c = 0, 2p - 1 - s for c = 1)

The blocks are split over the V virtual stages in contiguous runs (``partition_layers``:
evenly, the first L mod V stages one more, or by a given partition); virtual stage 0 also
runs the model's first part (the embedding), stage V-1 its last part (final norm, head).
``stage_chunks`` keeps on this rank only what its chunks run, and gives the last stage
its own copy of a weight tied to the first (Megatron's embedding group).
"""
import numpy as np

from pdist import nn
from pdist.engine.backend import xp
from pdist.models.moe import moe_layers, stage_aux
from pdist.models.plan import get, put
from pdist.parallel.pipeline.schedules import virtual_stage


def partition_layers(n_layers, n_stages, partition=None):
    """[(start, end)] for each stage: contiguous runs covering range(n_layers).
    Default: n_layers // n_stages each, the first n_layers % n_stages one more;
    ``partition``: explicit layer counts per stage (uneven splits)."""
    if n_stages > n_layers:
        raise ValueError(f"pipeline: {n_stages} (virtual) stages but only {n_layers} layers to split; "
                         f"use at most {n_layers} stages (pp * chunks) or a deeper model")
    if partition is None:
        counts = [n_layers // n_stages + (i < n_layers % n_stages) for i in range(n_stages)]
    else:
        counts = list(partition)
        if len(counts) != n_stages or any(not isinstance(c, (int, np.integer)) or c < 1 for c in counts) \
                or sum(counts) != n_layers:
            raise ValueError(f"pipeline partition {counts} must give {n_stages} positive layer counts "
                             f"summing to {n_layers} (one per virtual stage)")
    starts = np.cumsum([0] + counts)
    return [(int(starts[i]), int(starts[i + 1])) for i in range(n_stages)]


def check_pipeline(model, pplan, V, microbatches, inner_microbatches, partition, loss_fn, act_shape):
    """What a pipeline of ``model`` (its plan's ``pplan``) over V virtual stages refuses, the
    same on every rank, before any collective."""
    if 2 * microbatches * V > 32767:
        raise ValueError(f"pipeline: {microbatches} micro-batches x {V} stages exceed the MPI tag space")
    if inner_microbatches != 1:
        raise ValueError("pipeline: give the micro-batches to PipelineParallel, not to the model inside")
    if getattr(getattr(model, "config", None), "dropout", 0):
        raise ValueError("pipeline: dropout must be 0 (the micro-batches' masks would differ from the "
                         "single-process run); set dropout=0.0 in the model's config")
    if not isinstance(get(model, pplan.blocks), nn.ModuleList):
        raise TypeError(f"pipeline: {type(model).__name__} has no blocks to split (its plan's "
                        f"pipeline.blocks = {pplan.blocks!r} is not a module list); give the model a "
                        "parallel plan (docs/design.md) or use an nn.Sequential")
    if loss_fn is None and pplan.loss is None:
        raise ValueError("pipeline: the last stage needs a loss; pass loss_fn(out, target)")
    if V > 1 and act_shape is None and not pplan.hidden:
        raise ValueError("pipeline of an nn.Sequential: act_shape(k, rows, x) is needed")
    partition_layers(len(get(model, pplan.blocks)), V, partition)


def _remove(parent, name):
    """Drop child module ``name`` (this rank does not hold it)."""
    parent._modules.pop(name, None)
    object.__setattr__(parent, name, None)


class Chunk:
    """One virtual stage: its layers applied in order, y = f_b(...f_a(x)). ``losses``: what
    the stage adds to the step's loss beyond the last stage's loss (none here; a mixture of
    experts' balancing losses: ``ExpertChunk``), ``start(scale)`` empties it each step."""

    def __init__(self, layers):
        self.layers, self.losses, self.scale = layers, [], 1.0

    def start(self, scale):
        """A new step; ``scale``: the factor backward runs the loss with (fp32: S/m)."""
        self.losses, self.scale = [], scale

    def __call__(self, x):
        for f in self.layers:
            x = f(x)
        return x


class ExpertChunk(Chunk):
    """A stage holding MoE layers: the sum of their load-balancing losses rides on the stage's
    output (``moe.stage_aux``: its gradient ``scale``, as the loss's backward, Megatron's
    MoEAuxLossAutoScaler), and its value joins the step's loss (``losses``)."""

    def __call__(self, x):
        out, aux = stage_aux(self.layers, super().__call__(x), self.scale)
        if aux is not None:
            self.losses.append(aux)
        return out


def chunk_of(layers):
    """The stage that runs ``layers``: an ``ExpertChunk`` when they hold MoE layers."""
    moe = any(moe_layers(f) for f in layers if isinstance(f, nn.Module))
    return (ExpertChunk if moe else Chunk)(layers)


def _copy_of(w, name):
    """A stage's own Parameter equal to ``w`` (same piece of the same tensor; a meta ``w``
    gives a meta copy): the last stage's copy of a tied weight (Megatron's embedding group)."""
    copy = nn.Parameter(xp.zeros(0, dtype=w.dtype), name=name)
    copy.data = w.data.copy()
    copy.global_name = getattr(w, "global_name", w.name)
    copy.global_shape = getattr(w, "global_shape", tuple(w.shape))
    if getattr(w, "cut", None) is not None:
        copy.cut = w.cut
    return copy


def stage_chunks(model, pplan, p, s, v, partition, placement="loop"):
    """This rank's v chunks of ``model`` as its plan cuts it ([first] + blocks + [last],
    pdist/models/plan.py), chunk c being virtual stage ``virtual_stage(c, p, s, placement)``
    ("loop": c p + s; "v": s, then 2p - 1 - s, so rank 0 holds the first and the last);
    prunes from ``model`` what this rank does not hold. Returns the chunks and this rank's
    side of every tied pair (the ranks of the first and the last stage, when they differ)."""
    V, h = p * v, get(model, pplan.blocks)
    blocks = list(h)
    spans = partition_layers(len(blocks), V, partition)
    mine = [virtual_stage(c, p, s, placement) for c in range(v)]
    head = [getattr(model, pplan.first)] if pplan.first else []
    tail = [getattr(model, pplan.last)] if pplan.last else []
    chunks = [chunk_of((head if k == 0 else []) + blocks[slice(*spans[k])] + (tail if k == V - 1 else []))
              for k in mine]
    keep = {str(i) for k in mine for i in range(*spans[k])}
    for name in [n for n in h._modules if n not in keep]:
        _remove(h, name)
    first, last, tied = 0 in mine, V - 1 in mine, []
    for dst, src in pplan.tied.items():
        if last and not first:
            put(model, dst, _copy_of(get(model, src), dst))
        if p > 1 and first != last:                   # both on one rank ("v"): one weight, no sync
            tied.append(get(model, src if first else dst))
    for path in (pplan.first_modules if not first else ()) + (pplan.last_modules if not last else ()):
        parent, _, name = path.rpartition(".")
        _remove(get(model, parent), name)
    return chunks, tied


__all__ = ["partition_layers", "stage_chunks", "Chunk", "ExpertChunk", "check_pipeline"]
