"""Where every piece of every parameter lives: the one description of state.

A rank holds *pieces* of the single-process model's tensors. A piece says

    global[name][offsets[0] : offsets[0] + shape[0], ...]  ==  piece.view(tensor.data)

where ``tensor`` is what the optimizer updates on this rank (a Parameter, or a
ZeRO flat shard) and ``view`` cuts the piece out of it:

    view(a) = a.reshape(-1)[start : start + prod(box)].reshape(box)[slices]

* one process, data parallel, a pipeline stage: one piece per parameter, the
  whole tensor (``start = 0``, ``box = shape``, full slices);
* tensor parallel: ``slices`` keep this rank's rows or columns (three pieces for
  a fused [Q | K | V] matrix, one per block: ``Cut`` records the cut on the parameter);
* ZeRO: a flat shard holds a contiguous range of each parameter's flattened
  elements; ``flat_boxes`` cuts the range into rectangular boxes (a partial first
  row, whole rows, a partial last row), each a view of the shard. Padding is in no
  piece, so it is never visible.

The same pieces describe Adam's m and v (they have their tensor's shape), so one
mechanism gives ``full_state_dict``, ``load_full_state_dict`` and
``sharded_state_dict`` for every strategy and every composition.
"""
import math
from collections import namedtuple

from pdist.engine.backend import array_module, to_numpy

Shard = namedtuple("Shard", ["data", "global_shape", "offsets"])


class Cut(namedtuple("Cut", ["dim", "rank", "size", "stride"])):
    """Where a tensor-parallel layer cut its parameter (Megatron's ``partition_dim`` and
    ``partition_stride``, recorded on the parameter by the layer that makes the cut): the
    tensor's axis ``dim`` is cut into ``stride`` equal groups (3 for a fused [Q|K|V]), each
    group into ``size`` chunks; rank ``rank`` keeps chunk ``rank`` of every group, in order."""

    def blocks(self, global_shape):
        """[(local slices, global offsets)]: the ``stride`` blocks this rank holds."""
        n = global_shape[self.dim]
        if n % (self.size * self.stride):
            raise ValueError(f"axis {self.dim} of a {tuple(global_shape)} tensor does not split into "
                             f"{self.size} ranks x {self.stride} fused parts; choose sizes divisible by "
                             f"{self.size * self.stride}")
        c, out = n // (self.size * self.stride), []
        for j in range(self.stride):
            sl = [slice(0, d) for d in global_shape]
            sl[self.dim] = slice(j * c, (j + 1) * c)
            off = [0] * len(global_shape)
            off[self.dim] = j * (n // self.stride) + self.rank * c
            out.append((tuple(sl), tuple(off)))
        return out

    def take(self, a):
        """This rank's part of the full array ``a``: its blocks, concatenated along ``dim``."""
        parts = []
        for sl, off in self.blocks(a.shape):
            box = list(sl)
            box[self.dim] = slice(off[self.dim], off[self.dim] + sl[self.dim].stop - sl[self.dim].start)
            parts.append(a[tuple(box)])
        return parts[0].copy() if len(parts) == 1 else array_module(a).concatenate(parts, axis=self.dim)
Shard.__doc__ = "One rank's piece of a tensor: a NumPy array, the tensor's full shape, the piece's start per axis."


class Piece:
    """``view(tensor.data)`` is ``global[name]`` at ``offsets`` (shape ``shape``)."""

    __slots__ = ("name", "global_shape", "offsets", "tensor", "start", "box", "slices")

    def __init__(self, name, global_shape, offsets, tensor, start, box, slices):
        self.name, self.global_shape, self.offsets = name, tuple(global_shape), tuple(offsets)
        self.tensor, self.start, self.box, self.slices = tensor, int(start), tuple(box), tuple(slices)

    @property
    def shape(self):
        return tuple(s.stop - s.start for s in self.slices)

    def view(self, a):
        """The piece inside ``a`` (the tensor's data, or an optimizer state of its shape)."""
        n = math.prod(self.box)
        return a.reshape(-1)[self.start:self.start + n].reshape(self.box)[self.slices]

    def key(self):
        return (self.name, self.offsets, self.shape)

    def __repr__(self):
        return f"<Piece {self.name}{list(self.global_shape)} at {list(self.offsets)} shape {list(self.shape)}>"


def whole(name, tensor, global_shape=None, cut=None):
    """Pieces of a parameter of ``name`` that holds the blocks of ``cut`` (a Cut of the
    tensor of ``global_shape``; default: the whole tensor, at offset 0)."""
    shape = tuple(tensor.shape)
    gshape = tuple(global_shape or shape)
    local = cut.blocks(gshape) if cut is not None else [(tuple(slice(0, d) for d in shape), (0,) * len(shape))]
    return [Piece(name, gshape, off, tensor, 0, shape, sl) for sl, off in local]


def flat_boxes(shape, a, b):
    """Cut the flat range [a, b) of a C-ordered array of ``shape`` into contiguous
    rectangular boxes: [(flat start, origin per axis, box shape)]."""
    if a >= b:
        return []
    if not shape:
        return [(0, (), ())]
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)

    def row(i, lo, hi):          # part of row i: a box with a leading 1
        return [(i * inner + s, (i,) + o, (1,) + bs) for s, o, bs in flat_boxes(shape[1:], lo, hi)]
    if i0 == i1:
        return row(i0, r0, r1)
    out = []
    if r0:
        out += row(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append((i0 * inner, (i0,) + zeros, (i1 - i0,) + tuple(shape[1:])))
    if r1:
        out += row(i1, 0, r1)
    return out


def reshard_flat(pieces, shape, flat_lo, flat_hi, shard, shard_lo):
    """The pieces of one parameter (``pieces``, on a parameter of ``shape``) that fall
    in the flat range [flat_lo, flat_hi) of that parameter, re-expressed on ``shard``,
    a 1-D tensor whose element 0 is the parameter's flat element ``shard_lo``."""
    out = []
    for start, origin, box in flat_boxes(tuple(shape), flat_lo, flat_hi):
        for p in pieces:
            lo = [max(o, s.start) for o, s in zip(origin, p.slices)]
            hi = [min(o + n, s.stop) for o, n, s in zip(origin, box, p.slices)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            offsets = tuple(off + low - s.start for off, low, s in zip(p.offsets, lo, p.slices))
            slices = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, origin))
            out.append(Piece(p.name, p.global_shape, offsets, shard, start - shard_lo, box, slices))
    return out


def box_slices(piece):
    """Slices of the global tensor that a piece covers."""
    return tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape))


def shards_of(pieces, optimizer=None):
    """{key: [Shard]}: parameters under their names; with an optimizer, its state as
    ``optimizer.exp_avg.<name>``, ``optimizer.exp_avg_sq.<name>`` (pieces like the
    parameter's) and ``optimizer.step.<name>`` (a scalar)."""
    out = {}
    for p in pieces:
        out.setdefault(p.name, []).append(Shard(to_numpy(p.view(p.tensor.data)).copy(), p.global_shape,
                                                p.offsets))
        state = optimizer.state.get(id(p.tensor)) if optimizer is not None else None
        for k, v in (state or {}).items():
            key = f"optimizer.{k}.{p.name}"
            if hasattr(v, "shape") and v.shape == p.tensor.data.shape:
                out.setdefault(key, []).append(Shard(to_numpy(p.view(v)).copy(), p.global_shape, p.offsets))
            elif key not in out:
                out[key] = [Shard(to_numpy(v).copy(), (), ())]
    return out


__all__ = ["Piece", "Shard", "Cut", "whole", "flat_boxes", "reshard_flat", "box_slices", "shards_of"]
