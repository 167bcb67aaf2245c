"""What a pipeline step measures, kept by a step hook (pdist/engine/hooks.py) around its passes,
so that the executor (pipeline_parallel.py) holds the schedule's algorithm only:

    peak_stash         the most (micro-batch, chunk) forwarded and not yet through their BACKWARD
                       or W (W reads what B kept): what ``simulate.check_schedule`` plans
    peak_held_w        the most (micro-batch, chunk) between B and W (a zero-bubble schedule)
    peak_held_w_bytes  the bytes those hold (W's part only: the memory a zero-bubble schedule
                       trades for its bubble; split_backward.py)
    timeline           with ``record_timeline = True``: the pp ranks' clocks aligned at a barrier
                       when the step's compute starts, then [(Instr, start, end)] of every pass,
                       in seconds from there (``gather_timeline``: every stage's, on pp rank 0)

The counts read no clock; the timeline reads two per pass, only when asked for. The hook is
subscribed by default, for every pipeline; for any other strategy it does nothing.
"""
import time

from pdist.engine import hooks
from pdist.parallel.pipeline.instructions import PASSES, Instr

_OP = {name: op for op, name in PASSES.items()}


class _Pass:
    """Around one pass of ``pipe``: its counts after it, its span when timed."""

    __slots__ = ("pipe", "name", "args", "t0")

    def __init__(self, pipe, name, args):
        self.pipe, self.name, self.args = pipe, name, args

    def __enter__(self):
        if self.pipe.record_timeline:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        p = self.pipe
        if p.record_timeline:
            p.timeline.append((Instr(_OP[self.name], self.args["mb"], self.args["chunk"]), self.t0 - p.t_start,
                               time.perf_counter() - p.t_start))
        if self.name == "forward":
            p.peak_stash = max(p.peak_stash, len(p._stash) + len(p._held_w))    # W reads its stash too
        elif self.name == "backward_input":
            p.peak_held_w = max(p.peak_held_w, len(p._held_w))
            p.peak_held_w_bytes = max(p.peak_held_w_bytes, sum(h.nbytes for h in p._held_w.values()))


class PipelineStats(hooks.StepHook):
    """The step's pipeline statistics (module docstring); a default hook: always subscribed."""

    default, pipe = True, None

    def begin(self, s):
        self.pipe = p = next((x for x in s.model.chain() if getattr(x, "record_timeline", None) is not None), None)
        if p is not None:
            p.timeline, p.peak_stash, p.peak_held_w, p.peak_held_w_bytes = [], 0, 0, 0

    def enter(self, s, phase):
        p = self.pipe
        if phase == "compute" and p is not None and p.record_timeline:
            p.group.barrier()                        # the pp ranks' clocks aligned at the step's start
            p.t_start = time.perf_counter()

    def span(self, name, **args):
        p = self.pipe
        return _Pass(p, name, args) if p is not None and name in _OP else None


def gather_timeline(pipe):
    """Every stage's measured [(Instr, start, end)] of the last step with
    ``record_timeline = True``, in seconds from the step's aligned start, on pp rank 0
    (None elsewhere). Collective over the pp group. Feed it to
    ``simulate.bubble_fraction`` (measured idle per stage) or to pipeline.draw."""
    return pipe.group.gather_object(pipe.timeline, dst=0)


STATS = hooks.subscribe(PipelineStats())

__all__ = ["PipelineStats", "gather_timeline", "STATS"]
