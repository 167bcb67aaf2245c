"""Where one GPT training step's time goes, per op, forward and backward apart, beside the BLAS floor.

    python bench/profile_step.py                    # both sizes of bench/step_time.py, float32
    python bench/profile_step.py --sizes large --steps 5

Every ``Function`` subclass's ``forward`` and ``backward`` is wrapped with a clock, and so are
the optimizer step (AdamW), ``zero_grad``, and the autograd engine's leaf accumulation (the
copy of a first gradient into ``.grad``, ``+=`` after). What is left of the step is the engine
itself (graph walk, pending-gradient sums, hooks) and Python around the ops. The clock wraps
cost a few microseconds per op, so the profiled step is a little slower than the plain one
(the table prints both). Every figure is the median over the profiled steps.

Rows group the ops: matmul (Linear, MatMul: the GEMMs plus the bias add and reshapes),
attention (pdist.engine.attention's fused Function: two batched GEMMs forward and three backward,
the mask, the softmax), LayerNorm, GELU, reshape/permute, cross-entropy, embedding, residual
adds, AdamW, the leaf accumulation, and the rest (engine + Python). The share is of the
profiled step. The BLAS floor (bench/step_time.py: every GEMM of the step, the attention's
included, alone on preallocated outputs) is the least the matmul and attention rows together
can cost.
"""
import argparse
import collections
import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import step_time  # noqa: E402
from machine import header, record  # noqa: E402
from pdist.engine import autograd, backprop  # noqa: E402
from pdist.models import gpt
from pdist.course import lesson
from pdist import optim

GROUPS = {"Linear": "matmul", "MatMul": "matmul", "LayerNorm": "LayerNorm", "GELU": "GELU",
          "CausalSelfAttention": "attention (fused)", "ScaledCausalSoftmax": "attention (fused)",
          "Permute": "reshape/permute", "Reshape": "reshape/permute", "GetItem": "reshape/permute",
          "CrossEntropy": "cross-entropy",
          "Embedding": "embedding", "Add": "residual add"}
TIMES = collections.defaultdict(float)  # (group, "fwd"|"bwd") -> seconds


def _subclasses(cls):
    for c in cls.__subclasses__():
        yield c
        yield from _subclasses(c)


def _clocked(fn, key):
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[key] += time.perf_counter() - t0
    wrapped.__wrapped_clock__ = fn
    return wrapped


def instrument():
    """Wrap every Function's forward/backward, AdamW's update, zero_grad and leaf accumulation."""
    for c in set(_subclasses(autograd.Function)):
        g = GROUPS.get(c.__name__, "other ops")
        for phase, attr in (("fwd", "forward"), ("bwd", "backward")):
            if attr in c.__dict__:
                setattr(c, attr, _clocked(c.__dict__[attr], (g, phase)))
    optim.AdamW.step = _clocked(optim.AdamW.step, ("AdamW", "opt"))
    backprop._accumulate_leaf = _clocked(backprop._accumulate_leaf, ("engine: leaf .grad copy/+=", "bwd"))


def profile(size, steps):
    over, B, _ = step_time.SIZES[size]
    cfg = gpt.GPTConfig(vocab_size=step_time.VOCAB, dtype="float32", **over)
    T = cfg.block_size
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, step_time.VOCAB, (B, T)), rng.integers(0, step_time.VOCAB, (B, T))
    model = gpt.GPT(cfg, seed=0)
    opt = lesson.make_adamw(model.parameters())
    floor = step_time.floor_step_fn(cfg, B, T)
    phase = {"fwd": 0.0, "bwd": 0.0, "zero_grad": 0.0}

    def step(timed):
        t0 = time.perf_counter()
        model.zero_grad()
        t1 = time.perf_counter()
        _, loss = model(x, y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        if timed:
            phase.update(zero_grad=t1 - t0, fwd=t2 - t1, bwd=t3 - t2)
        return time.perf_counter() - t0

    plain, fl = [], []
    for _ in range(2):
        step(False)
        floor()
    for _ in range(steps):  # plain steps (no wraps) interleaved with the floor
        plain.append(step(False))
        t0 = time.perf_counter()
        floor()
        fl.append(time.perf_counter() - t0)
    instrument_once()
    step(False)
    prof, per_op, per_phase = [], collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(steps):  # medians over steps: robust to a step hit by other load
        TIMES.clear()
        prof.append(step(True))
        for k, v in TIMES.items():
            per_op[k].append(v)
        for k, v in phase.items():
            per_phase[k].append(v)
    med = {k: float(np.median(v)) for k, v in per_op.items()}
    return cfg, B, float(np.median(plain)), float(np.median(fl)), float(np.median(prof)), med, \
        {k: float(np.median(v)) for k, v in per_phase.items()}


_done = []


def instrument_once():
    if not _done:
        instrument()
        _done.append(True)


def table(step_s, floor_s, prof_s, t, ph):
    groups = ["matmul", "attention (fused)", "LayerNorm", "GELU", "reshape/permute", "cross-entropy",
              "embedding", "residual add", "other ops", "engine: leaf .grad copy/+="]
    rows, acc = [], {"fwd": 0.0, "bwd": 0.0}
    for g in groups:
        f, b = t.get((g, "fwd"), 0.0), t.get((g, "bwd"), 0.0)
        if f + b == 0:
            continue
        acc["fwd"] += f
        acc["bwd"] += b
        rows.append([g, f * 1e3, b * 1e3, (f + b) * 1e3, f"{(f + b) / prof_s:.1%}",
                     f"{floor_s * 1e3:.2f}" if g == "matmul" else ""])
    adam = t.get(("AdamW", "opt"), 0.0)
    rows.append(["AdamW", 0.0, 0.0, adam * 1e3, f"{adam / prof_s:.1%}", ""])
    rest_f, rest_b = ph["fwd"] - acc["fwd"], ph["bwd"] - acc["bwd"]
    rows.append(["engine + Python (rest)", rest_f * 1e3, rest_b * 1e3, (rest_f + rest_b) * 1e3,
                 f"{(rest_f + rest_b) / prof_s:.1%}", ""])
    rows.append(["zero_grad", 0.0, 0.0, ph["zero_grad"] * 1e3, f"{ph['zero_grad'] / prof_s:.1%}", ""])
    rows.append(["step (profiled)", ph["fwd"] * 1e3, ph["bwd"] * 1e3, prof_s * 1e3, "100%", ""])
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="lesson,large")
    p.add_argument("--steps", type=int, default=None, help="profiled steps (default 30 lesson, 4 large)")
    args = p.parse_args()
    print(header("profile_step"))
    out = {}
    with threadpool_limits(limits=1):
        for size in args.sizes.split(","):
            steps = args.steps or (30 if size == "lesson" else 4)
            cfg, B, step_s, floor_s, prof_s, t, ph = profile(size, steps)
            rows = table(step_s, floor_s, prof_s, t, ph)
            print(f"\n{size}: L{cfg.n_layer} C{cfg.n_embd} T{cfg.block_size} B{B}, float32, 1 BLAS thread; "
                  f"plain step {step_s * 1e3:.2f} ms (median of {steps}), profiled {prof_s * 1e3:.2f} ms, "
                  f"BLAS floor {floor_s * 1e3:.2f} ms (plain/floor {step_s / floor_s:.2f}x)")
            print(lesson.table(rows, ["op", "fwd ms", "bwd ms", "total ms", "share", "BLAS floor ms"],
                               floatfmt="{:.2f}"))
            out[size] = {"plain_step_s": step_s, "floor_s": floor_s, "profiled_step_s": prof_s,
                         "rows": rows}
    print("\nrecorded:", record("profile_step", out))


if __name__ == "__main__":
    main()
