"""One description of state for every layout (docs/design.md, "One description of state").

Every strategy says where each piece of each single-process tensor lives on this rank
(``pieces()``, layout.py). From the pieces alone, for every layout and composition:

    sharded_state_dict(opt)   {name: [Shard(data, global_shape, offsets)]}: this rank's pieces of
                              every parameter and of Adam's m, v and step; no communication
    full_state_dict()         the single-process state_dict on every rank: each element written by
                              its owner (the highest rank holding it), then one all-reduce (exact)
    load_full_state_dict(sd)  the inverse: each rank copies its pieces out of the full arrays
"""
import numpy as np

from pdist.engine.backend import to_numpy, xp
from pdist.parallel.layout import box_slices, shards_of


class StateDicts:
    """The state-dict methods of ``Strategy``: they read ``pieces()``, ``span_group()``,
    ``module`` and ``after_load()``."""

    def sharded_state_dict(self, optimizer=None):
        """{key: [Shard(data, global_shape, offsets)]}: this rank's pieces of every
        parameter (HF GPT-2 names) and, with ``optimizer``, of Adam's m, v and step
        (``optimizer.exp_avg.<name>``, ...). No padding; replicas appear on every rank
        that holds them. Local: no communication."""
        return shards_of(self.pieces(), optimizer)

    def full_state_dict(self):
        """{name: full NumPy array}, exactly the single-process model's, on every rank.
        Collective over ``span_group()``: the names and shapes (an object all-gather),
        then each element's owner, the highest rank holding it (an all-reduce, max), and
        the values each owner writes (an all-reduce, sum: exact, one non-zero term)."""
        group, pieces = self.span_group(), self.pieces()
        mine = {p.name: p.global_shape for p in pieces}
        shapes = {}
        for d in (group.all_gather_object(mine) if group.size > 1 else [mine]):
            shapes.update(d)
        names = self._ordered(shapes)
        starts, n = {}, 0
        for name in names:
            starts[name] = n
            n += int(np.prod(shapes[name]))

        def box(flat, p):
            return flat[starts[p.name]:starts[p.name] + int(np.prod(shapes[p.name]))].reshape(
                shapes[p.name])[box_slices(p)]
        dtype = pieces[0].tensor.data.dtype if pieces else np.float64
        owner, me = xp.zeros(n, dtype=dtype), group.rank + 1
        for p in pieces:
            box(owner, p)[...] = me
        if group.size > 1:
            group.all_reduce(owner, op="max")
        if not bool(to_numpy((owner > 0).all())):  # explicit host copy of one flag
            raise RuntimeError("full_state_dict: some elements are held by no rank (a strategy lost a piece)")
        flat = xp.zeros(n, dtype=dtype)
        for p in pieces:
            dst = box(flat, p)
            xp.copyto(dst, p.view(p.tensor.data), where=box(owner, p) == me)
        if group.size > 1:
            group.all_reduce(flat)
        flat = to_numpy(flat)
        return {name: flat[starts[name]:starts[name] + int(np.prod(shapes[name]))].reshape(shapes[name]).copy()
                for name in names}

    def _ordered(self, shapes):
        cfg = getattr(self.module, "config", None)
        order = list(cfg.param_shapes()) if cfg is not None and hasattr(cfg, "param_shapes") else []
        return [k for k in order if k in shapes] + sorted(k for k in shapes if k not in order)

    def load_full_state_dict(self, state_dict):
        """The inverse of ``full_state_dict``: each rank copies its pieces out of the full
        arrays (the model's own names; keys no piece needs, such as a tied head's copy or
        attention masks, are ignored).
        Raises one error listing missing or misshaped keys before anything is written."""
        pieces = self.pieces()
        problems = sorted({f"missing {p.name}" for p in pieces if p.name not in state_dict} |
                          {f"{p.name}: {tuple(np.shape(state_dict[p.name]))} vs {p.global_shape}"
                           for p in pieces if p.name in state_dict
                           and tuple(np.shape(state_dict[p.name])) != p.global_shape})
        if problems:
            raise KeyError(f"load_full_state_dict into {type(self).__name__}: " + "; ".join(problems))
        for p in pieces:
            p.view(p.tensor.data)[...] = xp.asarray(np.asarray(state_dict[p.name])[box_slices(p)],
                                                    dtype=p.tensor.data.dtype)
        self.after_load()


__all__ = ["StateDicts"]
