"""The host's own costs on this machine, measured once per process, for the planner's "this
machine" profile (pdist.plan.measured): seconds of pdist's dispatch per op (``op_s``), of the
optimizer's step per tensor (``step_s``), and the bandwidth of one large copy (``mem_bw``)."""
import time

import numpy as np

_bw, _op = [], []


def host_op_cost(reps=5):
    """Seconds of host work per pdist op (module doc: op_s), measured once per process in the
    current default dtype: pdist's own dispatch (Function.apply, the tape, backward's walk)."""
    if not _op:
        from pdist.engine import autograd
        from pdist.models.gpt import GPT, GPTConfig
        from pdist.parallel import Local
        model = Local(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8), 0))
        x = np.random.default_rng(0).integers(0, 32, (2, 8))
        orig, n = autograd.Function.__dict__["apply"], [0]

        def counting(cls, *a, **kw):
            n[0] += 1
            return orig.__func__(cls, *a, **kw)
        autograd.Function.apply = classmethod(counting)
        try:
            model.forward_backward(x, x)
        finally:
            autograd.Function.apply = orig
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            model.forward_backward(x, x)
            best = min(best, time.perf_counter() - t0)
        _op.append((best / max(n[0], 1), n[0], _step_cost(model, x)))
    return _op[0][0]


def _step_cost(model, x, reps=5):
    """Seconds of AdamW's step and zero_grad per parameter tensor, best of ``reps`` (each after
    a forward_backward, untimed, so that every tensor has its gradient)."""
    from pdist.optim import AdamW
    params = list(model.parameters())
    opt, best = AdamW(params, lr=1e-3), float("inf")
    for _ in range(reps):
        model.forward_backward(x, x)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        best = min(best, time.perf_counter() - t0)
    return best / len(params)


def host_step_cost():
    """Seconds of the optimizer's host work per tensor it steps (module doc: step_s)."""
    host_op_cost()
    return _op[0][2]


def memory_bandwidth():
    """Bytes per second of one large copy (read + write), best of 3, measured once."""
    if not _bw:
        a = np.ones(4 * 2 ** 20)
        b = np.empty_like(a)
        best = float("inf")
        for _ in range(4):
            t0 = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - t0)
        _bw.append(2 * a.nbytes / max(best, 1e-9))
    return _bw[0]
