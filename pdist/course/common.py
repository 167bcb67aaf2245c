"""What every exercise check uses: the failure type, comparisons, the small GPT and
its single-process reference run (pdist/course/checks.py runs the checks)."""
import importlib.util
import os
import sys

import numpy as np

RTOL = 1e-9
SEED, STEPS, BATCH = 0, 3, 12
SOLUTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "solutions.py")
NOT_IN_COPY = ("the reference answers (pdist/course/solutions.py) are not in a student copy of the course "
               "(made by `make handout`); grade your own files with `make grade` (no --reference)")


def reference_available():
    """True in the instructor's copy, False in a handout (pdist/course/solutions.py is withheld)."""
    return os.path.isfile(SOLUTIONS)


class CheckFailed(AssertionError):
    """A check's verdict: ``str(e)`` the one line the table shows, ``e.detail`` (optional)
    the full text the grader shows under it (an error's whole message, values that differ)."""

    def __init__(self, msg, detail=""):
        super().__init__(msg)
        self.detail = detail


def need(cond, msg):
    if not cond:
        raise CheckFailed(msg)


def load(source):
    if source == "reference":
        if not reference_available():
            raise ImportError(NOT_IN_COPY)
        from pdist.course import solutions as exercise_solutions
        return exercise_solutions
    spec = importlib.util.spec_from_file_location("student_exercise", source)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(source)))
    spec.loader.exec_module(mod)
    return mod


def close(a, b, what, rtol=RTOL, atol=1e-12):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    need(a.shape == b.shape, f"{what}: shape {a.shape}, expected {b.shape}")
    if not np.allclose(a, b, rtol=rtol, atol=atol):
        err = np.max(np.abs(a - b) / (np.abs(b) + 1e-300)) if a.size else 0.0
        bad = np.argwhere(~np.isclose(a, b, rtol=rtol, atol=atol))
        where = f"; {len(bad)} of {a.size} values differ, first at index {tuple(int(i) for i in bad[0])}: " \
                f"got {a[tuple(bad[0])]:.6g}, expected {b[tuple(bad[0])]:.6g}" if len(bad) and a.ndim else ""
        raise CheckFailed(f"{what} differs from pdist's (max relative error {err:.2g}{_ratio(a, b)})",
                          detail=f"{what}: max relative error {err:.3g}{where}")


def _ratio(a, b):
    """', got = k x expected' when ``a`` is (nearly) a constant multiple k != 1 of ``b``."""
    bb = float(np.vdot(b, b))
    if not np.all(np.isfinite(a)) or bb == 0.0:
        return ""
    k = float(np.vdot(a, b)) / bb
    if abs(k - 1) > 1e-6 and np.allclose(a, k * b, rtol=1e-6, atol=1e-12):
        return f"; got = {k:.4g} x expected"
    return ""


def sub_groups(world, sizes=(2, 3)):
    """[this rank's group] for each k in ``sizes`` with 1 < k < n: the world split into ranks
    [0, k) and [k, n) (so the ranks >= k run at n - k meanwhile), then the world itself. One job
    grades the student's code at several group sizes. Collective over ``world``."""
    out = []
    for k in sizes:
        if 1 < k < world.size:
            out.append(world.split(0 if world.rank < k else 1, name=f"first{k}" if world.rank < k else f"rest{k}"))
    return out + [world]


def close_dicts(got, want, what):
    need(set(got) == set(want), f"{what}: tensor names differ")
    for k in want:
        close(got[k], want[k], f"{what}: {k}")


# ------------------------------------------------------------------ shared harness
def tiny_cfg(block_size=8):
    from pdist import data
    from pdist.models.gpt import GPTConfig
    tokens, tok = data.char_dataset(20_000)
    return GPTConfig(vocab_size=tok.vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16,
                     dtype="float64"), tokens


def batches(cfg, tokens, batch=BATCH):
    from pdist import data
    return lambda step: data.get_batch(tokens, batch, cfg.block_size, SEED, step)


def reference_run(cfg, tokens, steps=STEPS, batch=BATCH):
    """(losses, state_dict) of single-process training: pdist's own, through the one loop."""
    from pdist.models import gpt
    from pdist.course import lesson
    from pdist.parallel.base import Local
    from pdist.training import train
    model = Local(gpt.GPT(cfg, seed=SEED))
    losses = train(model, lesson.make_adamw(model.parameters()), batches(cfg, tokens, batch), steps)
    return losses, model.module.state_dict()


def train_strategy(model, cfg, tokens, steps=STEPS, on_step=None):
    from pdist.course import lesson
    from pdist.training import train
    return train(model, lesson.make_adamw(model.parameters()), batches(cfg, tokens), steps, on_step=on_step)


def equal_to_one_process(model, cfg, tokens):
    """Train ``model`` (a strategy of the one shape) STEPS steps and require its losses and
    its full parameters to equal single-process training on the same batches."""
    ref_losses, ref_sd = reference_run(cfg, tokens)
    close(train_strategy(model, cfg, tokens), ref_losses, "the loss per step")
    close_dicts(model.full_state_dict(), ref_sd, f"after {STEPS} steps the parameters")
    return model


def one_process_grads(cfg, tokens, group, average):
    """One forward/backward of the tiny GPT on this rank's shard of batch 0, then
    ``average(params, group)``: {name: p.grad}. With group=None: the whole batch, one process."""
    from pdist.data import shard
    from pdist.models import gpt
    model = gpt.GPT(cfg, seed=SEED)
    x, y = batches(cfg, tokens)(0)
    if group is not None:
        x, y = shard((x, y), group.rank, group.size)
    model(x, y)[1].backward()
    if group is not None:
        average([p for _, p in model.named_parameters()], group)
    return {k: np.array(p.grad) for k, p in model.named_parameters()}


def ring_bytes(nbytes, n, factor=1):
    return factor * (n - 1) * nbytes // n


# ------------------------------------------------------------------ 01 ring all-reduce
