"""How long each step's gradient synchronization took after backward: the communication
that backward did not hide (Li et al., "PyTorch Distributed", VLDB 2020, measure it the same way).

    with sync_wait.record():               # subscribed for the block (pdist/engine/hooks.py)
        loss = model.forward_backward(x, y)
    model.last_wait_seconds                # this step's grad_sync phase, in seconds

The grad_sync phase is ``finish_grad_sync``: bucketed DDP issues the buckets backward did not
complete and waits for every all-reduce in flight; the naive DDP all-reduces every gradient
there, one by one. Its length on this rank's clock, from the phase's start to its end, is the
wait. Nothing is measured outside ``record()``: the strategies read no clock.
"""
import contextlib
import time

from pdist.engine import hooks


class SyncWait(hooks.StepHook):
    """Sets ``model.last_wait_seconds`` (the outermost strategy's) after each step's grad_sync."""

    def enter(self, s, phase):
        if phase == "grad_sync":
            self.t0 = time.perf_counter()

    def exit(self, s, phase):
        if phase == "grad_sync":
            s.model.last_wait_seconds = time.perf_counter() - self.t0


@contextlib.contextmanager
def record():
    """Subscribe a ``SyncWait`` for the block."""
    hook = hooks.subscribe(SyncWait())
    try:
        yield hook
    finally:
        hooks.unsubscribe(hook)


__all__ = ["SyncWait", "record"]
