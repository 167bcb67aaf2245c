"""A non-finite loss or gradient on any rank stops every rank with the same error.

``forward_backward`` counts what is non-finite on this rank (``check_finite``: on by default,
``check_finite=False`` or ``PDIST_CHECK_FINITE=0`` turns it off), and the
count travels in the per-step [loss, #non-finite] reduction of every wrapper, so every rank
learns of it in the same step; only then, on this rare path, do the ranks gather who saw
what and raise one ``NonFiniteError`` naming the step, the ranks and the parameters.
"""
from pdist import comm
from pdist.engine.backend import xp
from pdist.engine.env import env_flag
from pdist.errors import NonFiniteError
from pdist.optim import nonfinite_report


def finite_default():
    """``check_finite``'s default: on, unless ``PDIST_CHECK_FINITE=0`` (read when a ``Local``
    is built). On costs one ``isfinite`` pass over this rank's gradients per step; the count
    rides on the per-step loss all-reduce, so no extra collective (docs/failures.md)."""
    return env_flag("PDIST_CHECK_FINITE", True)


class NonFiniteCheck:
    """The non-finite check of ``Strategy``: it reads ``parameters()``, ``pieces()``,
    ``collect()`` and ``steps``."""

    def _nonfinite(self, loss):
        """Names of what is non-finite on this rank: "loss", and the single-process names
        of the parameters whose gradient piece here is (one check per tensor first)."""
        tensors = {str(id(t)): t for t in self.parameters()}
        found = nonfinite_report([(k, t.grad) for k, t in tensors.items()], loss)
        bad = {k for k in found if k != "loss"}
        names = ["loss"] if "loss" in found else []
        if bad:                     # which single-process parameters (a ZeRO shard spans several)
            names += sorted({p.name for p in self.pieces() if str(id(p.tensor)) in bad
                             and not bool(xp.isfinite(p.view(p.tensor.grad)).all())})
        return names

    def _raise_nonfinite(self, bad):
        """Every rank: gather who saw what (only on this rare path) and raise the same error."""
        me = comm.get_world().rank
        found = sorted(set(self.collect([(me, n) for n in bad])))
        losses = sorted({r for r, n in found if n == "loss"})
        grads = [(r, n) for r, n in found if n != "loss"]
        parts = [f"loss on rank(s) {losses}"] if losses else []
        if grads:
            shown = ", ".join(f"rank {r}: {n}" for r, n in grads[:6])
            parts.append(f"gradients of {len(grads)} tensor(s) ({shown}{', ...' if len(grads) > 6 else ''})")
        raise NonFiniteError(f"step {self.steps}: non-finite " + "; ".join(parts or ["values on another rank"])
                             + " (check_finite is on; a non-finite value on one rank reaches every rank "
                             "through the gradient averaging: lower the learning rate, check the data, or "
                             "train with check_finite=False / PDIST_CHECK_FINITE=0 to let it through).")


__all__ = ["NonFiniteCheck", "finite_default"]
