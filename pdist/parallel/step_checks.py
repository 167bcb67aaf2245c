"""The step's own bookkeeping, subscribed to its phases as the default step hooks
(pdist/engine/hooks.py), so ``forward_backward`` reads as its phases:

    StepStamp     order -30  begin: the training step into the model (``model.steps``) and into
                             every collective's check with the global batch's hash (comm.set_step,
                             batch_check.py); the stats' exit: the batch's hash off again; end: the
                             step counter on
    FiniteCheck   order -20  grad_sync's exit: this rank's non-finite count rides on the step's one
                             reduction (s.counts); end: when any rank counted, every rank raises
                             NonFiniteError together (nonfinite.py)
    IndexChecks   order -10  around compute: a device's token-id bounds read once (index_checks.py)

They sit outside the instruments (order 0 and up), so the straggler detector, the trace and
fault injection see the phases as before, and an injected NaN is counted. None reads a clock.
"""
from pdist import comm
from pdist.comm.flight_recorder import set_batch
from pdist.engine import hooks
from pdist.engine.index_checks import deferred_index_checks
from pdist.parallel.batch_check import take_pending


class StepStamp(hooks.StepHook):
    order, default = -30, True

    def begin(self, s):
        m = s.model
        m.steps = s.step
        pending = take_pending()            # the hash of the global batch local_batch was handed
        if m.stamps_step:                   # collectives carry the step (and the batch's hash: check_batch)
            comm.set_step(s.step, batch=pending if m.check_batch else 0)

    def exit(self, s, phase):
        if phase == "stats":
            set_batch(0)                    # the step's collectives are done; later ones carry no batch

    def end(self, s):
        s.model.steps = s.step + 1


class FiniteCheck(hooks.StepHook):
    order, default = -20, True

    def exit(self, s, phase):
        if phase == "grad_sync":
            m = s.model
            bad = m._nonfinite(s.results["compute"]) if m.check_finite else []
            s.results["nonfinite"] = (1 + len(s.counts), bad)   # [loss, *counts]: where its count travels
            s.counts.append(float(len(bad)))

    def end(self, s):
        slot, bad = s.results["nonfinite"]
        if s.results["stats"][slot] > 0:
            s.model._raise_nonfinite(bad)


class IndexChecks(hooks.StepHook):
    order, default = -10, True

    def around(self, s, phase):
        return deferred_index_checks() if phase == "compute" else None


DEFAULTS = (StepStamp(), FiniteCheck(), IndexChecks())
for _hook in DEFAULTS:
    hooks.subscribe(_hook)

__all__ = ["StepStamp", "FiniteCheck", "IndexChecks", "DEFAULTS"]
