"""Median time of one training step (forward + backward + AdamW) of pdist's GPT,
next to PyTorch eager on CPU with the same shapes and dtype, and next to the
BLAS-only floor: the same matrix products (forward and both backward products of
every matmul) timed alone, with nothing else around them.

    python bench/step_time.py                 # both sizes, float32, one BLAS thread
    python bench/step_time.py --sizes large --repeats 5 --dtype float64
    python bench/step_time.py --no-torch      # without the PyTorch column

Sizes: ``lesson`` is the lessons' model (pdist.course.lesson.gpt_config: 2 layers, 4 heads,
n_embd 64, T 32) at batch 16; ``large`` is matmul-heavy (4 layers, 8 heads, n_embd
512, T 256, batch 8). Everything runs with one BLAS thread (threadpoolctl, and
torch.set_num_threads(1)), so the numbers compare code, not thread counts.

The runs are interleaved (pdist, torch, floor, pdist, torch, floor, ...) so that
load from other processes on a shared machine hits all three alike; the table
reports medians and the spread (max/min of the pdist repeats) as a noise gauge.
Goals: pdist <= 1.0x PyTorch at both sizes, <= 1.15x the floor at the
large size. The header line says where it ran (bench/machine.py: CPU, cores, BLAS
kernel, numpy, load average); the JSON goes to bench/results/step_time.json.
PyTorch is optional: without it that column says "n/a".
"""
import argparse
import math
import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pdist.models import gpt  # noqa: E402
from pdist.course import lesson
from pdist.engine.backend import synchronize  # noqa: E402

VOCAB = 96  # about the char vocabulary of pdist.data.char_dataset()
SIZES = {  # model shape, batch size, default repeats
    "lesson": (dict(block_size=32, n_layer=2, n_head=4, n_embd=64), 16, 21),
    "large": (dict(block_size=256, n_layer=4, n_head=8, n_embd=512), 8, 7),
}


# --- pdist ---------------------------------------------------------------------------------
def pdist_step_fn(cfg, x, y):
    model = gpt.GPT(cfg, seed=0)
    opt = lesson.make_adamw(model.parameters())

    def step():
        model.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
    return step


# --- PyTorch (eager, CPU): the same GPT-2, weights copied from pdist's state_dict ---------------
def torch_step_fn(cfg, x, y):
    import torch
    import torch.nn.functional as tF

    dt = getattr(torch, cfg.dtype)
    sd = gpt.GPT(cfg, seed=0).state_dict()
    P = {k: torch.nn.Parameter(torch.tensor(v, dtype=dt)) for k, v in sd.items()}
    C, nh = cfg.n_embd, cfg.n_head
    T = x.shape[1]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    X, Y = torch.from_numpy(x), torch.from_numpy(y)

    def lin(h, name):  # pdist/HF Conv1D layout: W (in, out)
        return torch.addmm(P[name + ".bias"], h.reshape(-1, h.shape[-1]), P[name + ".weight"]) \
            .reshape(*h.shape[:-1], -1)

    def ln(h, name):
        return tF.layer_norm(h, (C,), P[name + ".weight"], P[name + ".bias"], 1e-5)

    def forward():
        B = X.shape[0]
        h = P["transformer.wte.weight"][X] + P["transformer.wpe.weight"][:T]
        for i in range(cfg.n_layer):
            p = f"transformer.h.{i}."
            q, k, v = lin(ln(h, p + "ln_1"), p + "attn.c_attn").split(C, dim=2)
            q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // nh))
            att = torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            a = (att @ v).transpose(1, 2).reshape(B, T, C)
            h = h + lin(a, p + "attn.c_proj")
            m = tF.gelu(lin(ln(h, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")
            h = h + lin(m, p + "mlp.c_proj")
        logits = ln(h, "transformer.ln_f") @ P["transformer.wte.weight"].T
        return tF.cross_entropy(logits.reshape(-1, logits.shape[-1]), Y.reshape(-1))

    opt = torch.optim.AdamW(list(P.values()), lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS,
                            weight_decay=lesson.WEIGHT_DECAY)

    def step():
        opt.zero_grad(set_to_none=True)
        forward().backward()
        opt.step()
    return step


# --- the BLAS-only floor --------------------------------------------------------------------
def matmul_shapes(cfg, B, T):
    """(batch, m, k, n) of every forward matmul of one GPT step."""
    C, nh, V = cfg.n_embd, cfg.n_head, cfg.vocab_size
    hs, N = C // nh, B * T
    layer = [(1, N, C, 3 * C), (B * nh, T, hs, T), (B * nh, T, T, hs), (1, N, C, C),
             (1, N, C, 4 * C), (1, N, 4 * C, C)]
    return layer * cfg.n_layer + [(1, N, C, V)]


def floor_step_fn(cfg, B, T):
    """Every forward product Y = A B and its two backward products dA = G B^T,
    dB = A^T G, on preallocated arrays (out=), so only BLAS time is measured."""
    rng = np.random.default_rng(0)
    dt = np.dtype(cfg.dtype)
    jobs = []
    for (b, m, k, n) in matmul_shapes(cfg, B, T):
        sq = (lambda *s: s[1:]) if b == 1 else (lambda *s: s)
        A = rng.standard_normal(sq(b, m, k)).astype(dt)
        W = rng.standard_normal(sq(b, k, n)).astype(dt)
        G = rng.standard_normal(sq(b, m, n)).astype(dt)
        jobs += [(A, W, np.empty(sq(b, m, n), dt)),
                 (G, np.swapaxes(W, -1, -2), np.empty(sq(b, m, k), dt)),
                 (np.swapaxes(A, -1, -2), G, np.empty(sq(b, k, n), dt))]

    def step():
        for a, b, out in jobs:
            np.matmul(a, b, out=out)
    return step


def have_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def bench(size, dtype, repeats, use_torch):
    over, B, default_repeats = SIZES[size]
    repeats = repeats or default_repeats
    cfg = gpt.GPTConfig(vocab_size=VOCAB, dtype=dtype, **over)
    T = cfg.block_size
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (B, T))
    y = rng.integers(0, VOCAB, (B, T))
    fns = {"pdist": pdist_step_fn(cfg, x, y), "floor": floor_step_fn(cfg, B, T)}
    if use_torch:
        fns["torch"] = torch_step_fn(cfg, x, y)
    times = {k: [] for k in fns}
    inner = max(1, int(0.1 / max(1e-4, _once(fns["pdist"]))))  # ~0.1 s per sample
    for f in fns.values():  # warm-up: first calls allocate optimizer state, caches
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            synchronize()  # the step's device work is done (no-op on CPU)
            times[k].append((time.perf_counter() - t0) / inner)
    med = {k: float(np.median(v)) for k, v in times.items()}
    best = {k: float(np.min(v)) for k, v in times.items()}
    spread = max(times["pdist"]) / min(times["pdist"])
    return cfg, B, med, best, spread, repeats, times


def _once(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="lesson,large")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--repeats", type=int, default=None, help="default: 21 (lesson), 7 (large)")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args()
    use_torch = have_torch() and not args.no_torch
    if use_torch:
        import torch
        torch.set_num_threads(1)
    rows, raw = [], {}
    with threadpool_limits(limits=1):
        for size in args.sizes.split(","):
            cfg, B, med, best, spread, n, raw[size] = bench(size, args.dtype, args.repeats, use_torch)
            tt, tb = med.get("torch"), best.get("torch")
            rows.append([size, n, f"L{cfg.n_layer} C{cfg.n_embd} T{cfg.block_size} B{B}",
                         f"{med['pdist'] * 1e3:.2f}", f"{tt * 1e3:.2f}" if tt else "n/a",
                         f"{med['pdist'] / tt:.2f}x" if tt else "n/a",
                         f"{best['pdist'] / tb:.2f}x" if tb else "n/a",
                         f"{med['floor'] * 1e3:.2f}", f"{med['pdist'] / med['floor']:.2f}x",
                         f"{best['pdist'] / best['floor']:.2f}x", f"{spread:.2f}"])
    print(f"step = forward + backward + AdamW, {args.dtype}, 1 BLAS thread; times are medians of "
          f"n interleaved repeats; (min) = the same ratio of the fastest repeats; "
          f"spread = slowest/fastest pdist repeat (noise)")
    print(lesson.table(rows, ["size", "n", "shape", "pdist ms", "torch ms", "pdist/torch", "(min)",
                              "floor ms", "pdist/floor", "(min)", "spread"]))
    from machine import report
    report("step_time", {"dtype": args.dtype, "rows": rows, "seconds": raw})


if __name__ == "__main__":
    main()
