"""What ``python -m pdist.train`` shows and keeps: the progress bar, the JSON-lines log, MFU.

MFU (Chowdhery et al., 2022, appendix B) is the model FLOPs a rank does per second over the peak
it could do: FLOPs per token ``6N + 12·L·C·T`` (N the parameters, L layers, C the width, T the
context: the matmuls of forward and backward, and attention's QKᵀ and AV, uncausal as PaLM counts
them), times tokens/s, over the world's ranks, over the peak. The peak is ``--peak-tflops``, or
this rank's measured GEMM rate: a 512-square matmul in the run's dtype, timed for 0.2 s at start
(on shared cores that is the shared rate, so MFU says how well the step uses what the rank gets).

The log (``log.jsonl``, rank 0) is one JSON object per line, each written by one ``write`` on a
file opened for appending, so an interrupted run leaves whole lines only::

    {"event": "start", "step": 0, "world_size": 4, "layout": {...}, "model": {...}, "flags": {...}}
    {"step": 10, "loss": 2.91, "lr": 0.003, "seconds": 0.05, "tokens_per_s": 10240.0, "mfu": 0.12}
    {"step": 50, "eval_loss": 2.87}
    {"event": "save", "step": 50, "path": "runs/train/ckpt/step-000050"}
    {"event": "end", "step": 300, "reason": "done"}        # or "interrupted"
"""
import collections
import json
import math
import os
import sys
import time

import numpy as np

from pdist.engine.backend import synchronize, xp


def flops_per_token(cfg):
    """6N + 12·L·C·T (PaLM's convention): pdist.measure.flops's count when this pdist has it
    (the waterfall's, so both print one MFU), else with N = every parameter."""
    try:
        from pdist.measure import flops
    except ImportError:
        return 6 * cfg.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    return flops.per_token(cfg, "6N+12LhT")


def measured_peak(dtype="float32", n=512, seconds=0.2):
    """FLOP/s of an n x n x n matmul on this rank's device (2n³ FLOPs per product);
    pdist.measure.flops's cached rate when this pdist has it."""
    try:
        from pdist.measure import flops
        return flops.gemm_rate(dtype)
    except ImportError:
        pass
    a = xp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype=dtype)
    a @ a
    synchronize()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or reps < 3:
        a @ a
        reps += 1
    synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


class Log:
    """``log.jsonl`` in ``--out``, appended to (a resumed run continues the file); rank 0 only."""

    def __init__(self, path, on=True):
        self.path, self.fd = path, (os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if on else None)

    def write(self, **record):
        if self.fd is not None:
            line = json.dumps({k: _finite(v) for k, v in record.items()}, allow_nan=False) + "\n"
            os.write(self.fd, line.encode())

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


class Progress:
    """Rank 0's progress: a bar redrawn in place on a terminal, else one plain line every
    ``every`` steps (and the last). Each line: step, loss, tokens/s, MFU, ETA."""

    def __init__(self, start, end, tokens_per_step, flops_per_step, peak, world, every, on=True, stream=None):
        self.stream = stream or sys.stdout
        self.start, self.end, self.every, self.on = start, end, every, on
        self.tokens, self.flops, self.peak, self.world = tokens_per_step, flops_per_step, peak, world
        self.tty = on and self.stream.isatty()
        self.last, self.busy, self.timed = None, 0.0, 0
        self.window = collections.deque(maxlen=every)      # the last steps' seconds: the shown rates
        self.open = False                                   # a bar is on the line (a terminal)

    def step(self, step, loss, lr):
        """After step ``step`` (0-based): its record for the log (seconds, tokens/s, MFU). The shown
        rates are the mean over the last ``every`` steps; the first step (warm-up) and the
        time in eval and saves (``resume_clock``) are left out of them and of the ETA."""
        now = time.perf_counter()
        dt = now - self.last if self.last is not None else float("nan")
        self.last = now
        if math.isfinite(dt):
            self.busy += dt
            self.timed += 1
            self.window.append(dt)
        rec = dict(step=step + 1, loss=loss, lr=lr, seconds=dt, tokens_per_s=self.tokens / dt,
                   mfu=self.flops / dt / self.world / self.peak)
        done = step + 1
        if self.on and (self.tty or done % self.every == 0 or done == self.end):
            mean = sum(self.window) / len(self.window) if self.window else float("nan")
            self._show(done, loss, self.tokens / mean, self.flops / mean / self.world / self.peak)
        return rec

    def resume_clock(self):
        """After an eval or a save: the next step's time starts now."""
        if self.last is not None:
            self.last = time.perf_counter()

    def _show(self, done, loss, tps, mfu):
        per = self.busy / self.timed if self.timed else float("nan")
        eta = per * (self.end - done)
        frac = (done - self.start) / max(1, self.end - self.start)
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = (f"[{bar}] {done}/{self.end}  loss {loss:.4f}  {_num(tps)} tok/s  MFU {_pct(mfu)}  "
                f"ETA {_eta(eta)}")
        if self.tty:
            self.open = done != self.end
            self.stream.write("\r" + line + "\x1b[K" + ("" if self.open else "\n"))     # (clears the rest)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def say(self, text):
        """A line of its own (eval, save), not glued to the bar."""
        if self.on:
            self.stream.write(("\n" if self.open else "") + text + "\n")
            self.open = False
            self.stream.flush()


def _num(v):
    return "-" if not math.isfinite(v) else (f"{v / 1e3:.1f}k" if v >= 1e4 else f"{v:.0f}")


def _pct(v):
    return "-" if not math.isfinite(v) else f"{100 * v:.2f}%"


def _eta(s):
    if not math.isfinite(s):
        return "-"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
