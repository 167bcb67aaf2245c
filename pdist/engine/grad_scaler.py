"""Dynamic loss scaling for fp16 (Micikevicius et al., 2018, sec. 3.2), with
``torch.amp.GradScaler``'s semantics and names.

fp16 keeps 5 exponent bits: gradients below 2^-24 flush to zero. Scaling the loss by
S moves every gradient up by S (backward is linear in the upstream gradient), and the
optimizer sees g = (S g) / S. S is dynamic:

    a step whose gradients hold inf or NaN is skipped, and S <- S * backoff_factor (0.5)
    after growth_interval (2000) steps in a row without one, S <- S * growth_factor (2)

S starts at init_scale = 2^16. Skipped steps are counted (``skipped``: in all;
``skipped_in_a_row``: since the last good step), and ``max_consecutive_skips`` (100) in a
row stop the run: ``update()`` raises NonFiniteError naming the count and the loss scale
(overflows back off in a few steps; a hundred in a row means a NaN in the weights or the
data, which no scale cures: skipping silently would train nothing). ``verbose=True``
prints one line per skip. All factors are powers of two, so scaling and
unscaling are exact (no rounding), and a run with a scaler equals one without it
as long as nothing overflows or flushes.

Alone, PyTorch's loop:

    scaler = GradScaler()
    scaler.scale(loss).backward()
    scaler.step(optimizer)          # unscale_ (if not done), skip when non-finite, else optimizer.step()
    scaler.update()

Under a strategy (``parallelize(..., precision="fp16")``, pdist/parallel/mixed_precision.py)
``forward_backward`` does the scaling, unscales into the fp32 masters, agrees on
"found inf" over every rank of the mesh, skips by leaving the masters without
gradients (``optimizer.step()`` then changes nothing), and calls ``update()``.
"""
import math

from pdist.engine.precision import any_nonfinite
from pdist.errors import NonFiniteError


class GradScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, max_consecutive_skips=100, verbose=False):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"GradScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval}")
        if max_consecutive_skips is not None and not (
                isinstance(max_consecutive_skips, int) and max_consecutive_skips >= 1):
            raise ValueError(f"GradScaler: max_consecutive_skips must be a positive integer or None (never "
                             f"stop), got {max_consecutive_skips!r}")
        self.max_consecutive_skips, self.verbose = max_consecutive_skips, bool(verbose)
        self.skipped = self.skipped_in_a_row = 0     # steps skipped: in all, and since the last good one
        self._scale = float(init_scale)
        self._growth_factor, self._backoff_factor = growth_factor, backoff_factor
        self._growth_interval, self._growth_tracker = int(growth_interval), 0
        self._enabled = bool(enabled)
        self._found_inf = None        # this step's verdict, once unscale_ (or a strategy) decided it
        self._unscaled = set()        # ids of the optimizers unscaled this step

    def is_enabled(self):
        return self._enabled

    def get_scale(self):
        return self._scale if self._enabled else 1.0

    def scale(self, loss):
        """loss * S (a Tensor or a number)."""
        return loss * self.get_scale() if self._enabled else loss

    def unscale_(self, optimizer):
        """g <- g / S for every parameter of ``optimizer``; records whether any is inf/NaN."""
        if not self._enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        grads = [p.grad for p in optimizer.parameters() if p.grad is not None]
        found = any_nonfinite(grads)
        inv = 1.0 / self._scale
        for g in grads:
            g *= inv
        self._found_inf = bool(self._found_inf) or found
        self._unscaled.add(id(optimizer))

    def step(self, optimizer):
        """optimizer.step() unless this step's gradients hold inf/NaN (then nothing)."""
        if not self._enabled:
            return optimizer.step()
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            return None
        return optimizer.step()

    def record(self, found_inf):
        """A strategy's verdict for this step (already agreed by every rank)."""
        self._found_inf = bool(self._found_inf) or bool(found_inf)

    def update(self):
        """Back off after a skipped step; grow after ``growth_interval`` good ones."""
        if not self._enabled:
            return
        if self._found_inf:
            self._skip()
        else:
            self.skipped_in_a_row = 0
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        if not math.isfinite(self._scale) or self._scale == 0:
            raise FloatingPointError(f"GradScaler: the loss scale became {self._scale}; the gradients are "
                                     f"non-finite at every scale (a NaN in the model, not an overflow)")
        self._found_inf, self._unscaled = None, set()

    def _skip(self):
        """A skipped step: count it, say it (verbose), stop after max_consecutive_skips, back off."""
        self.skipped += 1
        self.skipped_in_a_row += 1
        k = self.max_consecutive_skips
        if k is not None and self.skipped_in_a_row >= k:
            self._found_inf, self._unscaled = None, set()
            raise NonFiniteError(
                f"GradScaler: {self.skipped_in_a_row} steps in a row skipped (non-finite gradients at every "
                f"loss scale from {self._scale / self._backoff_factor ** (k - 1):g} down to {self._scale:g}; "
                f"{self.skipped} skipped in all): an overflow backs off in a few steps, so the weights, the "
                f"loss or the data hold NaN/inf. Find it (check_finite names the tensors under bf16/fp32), "
                f"or raise GradScaler(max_consecutive_skips=...)")
        if self.verbose:
            print(f"[GradScaler] skipped a step: non-finite gradients at loss scale {self._scale:g}; "
                  f"scale -> {self._scale * self._backoff_factor:g} ({self.skipped} skipped, "
                  f"{self.skipped_in_a_row} in a row)", flush=True)
        self._scale *= self._backoff_factor
        self._growth_tracker = 0

    def state_dict(self):
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, sd):
        self._scale, self._growth_factor = float(sd["scale"]), sd["growth_factor"]
        self._backoff_factor, self._growth_interval = sd["backoff_factor"], int(sd["growth_interval"])
        self._growth_tracker = int(sd["_growth_tracker"])


__all__ = ["GradScaler"]
