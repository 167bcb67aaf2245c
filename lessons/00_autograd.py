"""Lesson 00 -- autograd: train a small GPT in one process, with pdist's own engine.

    python lessons/00_autograd.py            # 1000 steps: 27-50 s on 2 loaded cores (README)
    python lessons/00_autograd.py --steps 50 --dtype float64 --json out.json
    python lessons/00_autograd.py --model llama   # Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention

Everything later in the course (data parallelism, ZeRO, tensor and pipeline
parallelism) is this loop with the work split across ranks:

    logits = model(x)                       # forward: each op records how it was made
    loss = cross_entropy(logits, y)
    loss.backward()                         # backward: chain rule, in reverse order
    opt.step()                              # AdamW, in place

``loss.backward()`` walks the recorded graph once in reverse topological order.
Every op knows its local derivative, for example for ``Y = X W``:
dX = dY W^T and dW = X^T dY. Gradients *accumulate* into ``param.grad`` until
``zero_grad()`` (PyTorch's contract), which is what micro-batching relies on.

The check at the end does not trust the engine: it compares a few of its
gradients with central finite differences, (L(w + h) - L(w - h)) / 2h, in
float64, and asks that the loss fell clearly.
"""
import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pdist import data  # noqa: E402
from pdist.course import lesson
from pdist.models import registry  # noqa: E402
from pdist.engine.backend import to_numpy  # noqa: E402
from pdist.engine.gradcheck import central_difference  # noqa: E402

STEPS = 1000
# (parameter, index) pairs for the finite-difference check: one from each kind of op, per model,
# and rows of a frequent character in the token tables (a rare one's gradient is near fd's noise)
TOKEN_ROWS = {"gpt2": ["transformer.wte.weight"], "llama": ["model.embed_tokens.weight", "lm_head.weight"]}
FD_ENTRIES = {"gpt2": [("transformer.wpe.weight", (7, 11)),
                       ("transformer.h.0.attn.c_attn.weight", (9, 70)), ("transformer.h.1.mlp.c_fc.bias", (40,)),
                       ("transformer.h.1.mlp.c_proj.weight", (100, 2)), ("transformer.ln_f.weight", (17,))],
              "llama": [("model.layers.0.self_attn.q_proj.weight", (9, 40)),
                        ("model.layers.0.self_attn.k_proj.weight", (20, 7)),
                        ("model.layers.1.mlp.gate_proj.weight", (100, 2)),
                        ("model.layers.1.mlp.down_proj.weight", (5, 150)),
                        ("model.layers.1.post_attention_layernorm.weight", (17,)), ("model.norm.weight", (5,))]}
FD_RTOL, FD_ATOL = 1e-5, 1e-9  # |backward - fd| <= rtol |fd| + atol (atol: fd's rounding, ~eps L / h)


def train(cfg, tokens, args):
    model = registry.build(cfg, seed=args.seed)
    opt = lesson.make_adamw(model.parameters())
    losses, times = [], []
    for step in range(args.steps):
        x, y = data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)  # (B, T) ints
        t0 = time.perf_counter()
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return model, losses, times


def finite_difference_check(model, cfg, tokens, entries, args, h=1e-6):
    """Analytic dL/dw (backward) vs (L(w + h) - L(w - h)) / 2h at each (name, index) of
    entries, in float64 on the trained weights."""
    cfg64 = lesson.config_from_args(args, cfg.vocab_size)
    cfg64.dtype = "float64"
    m = registry.build(cfg64, seed=args.seed)
    m.load_state_dict(model.state_dict())  # the trained weights, in float64
    x, y = data.get_batch(tokens, 4, cfg.block_size, args.seed, 10**6)  # a batch not trained on
    m.zero_grad()
    m(x, y)[1].backward()
    params = dict(m.named_parameters())
    rows = []
    for name, idx in entries:
        name = name.replace(".1.", f".{min(1, cfg.n_layer - 1)}.")        # any --n-layer
        p = params[name]
        idx = tuple(i % d for i, d in zip(idx, p.shape))                  # any --n-embd
        num = central_difference(lambda: m(x, y)[1].item(), p.data, idx, h)
        ana = float(to_numpy(p.grad[idx]))
        rel = abs(ana - num) / max(abs(num), 1e-30)
        rows.append((name, idx, ana, num, rel, abs(ana - num) <= FD_RTOL * abs(num) + FD_ATOL))
    return rows


def main():
    p = lesson.parser(__doc__, steps=STEPS, models=True, no_inject=(
        "lesson 00 trains one process with its own loop, outside the strategies that faults hook into; "
        "faults start with lesson 02, e.g. mpirun -n 2 python lessons/02_data_parallel.py --inject nan:rank=1,step=3"))
    args = lesson.validate(p, p.parse_args())  # bad flags: usage message, exit 2, before training
    # under mpirun (MPICH, Open MPI) this single-process lesson runs on rank 0 only
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if rank != 0:
        return
    with threadpool_limits(limits=1):  # one BLAS thread: small matrices, and "one core" is the budget
        run(args)


def run(args):
    tokens, tok = data.char_dataset()
    cfg = lesson.config_from_args(args, tok.vocab_size)
    model, losses, times = train(cfg, tokens, args)
    n_params = cfg.num_params()
    kv = f" ({cfg.n_kv_head} kv)" if args.model == "llama" else ""
    print(f"{type(model).__name__}: {cfg.n_layer} layers, {cfg.n_head} heads{kv}, n_embd {cfg.n_embd}, "
          f"T {cfg.block_size}, vocab {cfg.vocab_size}: {n_params:,} parameters, {args.dtype}, batch {args.batch_size}")
    shown = sorted(set(np.linspace(0, args.steps - 1, min(args.steps, 11)).astype(int)))
    print(lesson.table([[s, losses[s]] for s in shown], ["step", "loss"]))
    sec = float(np.median(times))
    print(f"median step (forward + backward + AdamW): {sec * 1e3:.2f} ms")

    prompt = "The "
    out = model.generate(tok.encode(prompt)[None, :], 160, temperature=0.8, seed=args.seed)
    print("\nsample:\n" + tok.decode(out[0]) + "\n")

    entries = [(n, (tok.stoi["e"], 3 + k)) for k, n in enumerate(TOKEN_ROWS[args.model])] + FD_ENTRIES[args.model]
    fd = finite_difference_check(model, cfg, tokens, entries, args)
    print(lesson.table([[n, str(i), a, b, f"{r:.1e}", "ok" if ok else "WRONG"] for n, i, a, b, r, ok in fd],
                       ["parameter", "index", "backward", "finite diff", "rel err", "agree"], floatfmt="{:.6e}"))

    k = max(1, min(10, args.steps // 4))
    start, end = losses[0], float(np.mean(losses[-k:]))
    fell = end < 0.85 * start
    fd_ok = all(ok for *_, ok in fd)
    result = {"name": "single", "model": args.model, "layout": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0},
              "dtype": args.dtype, "params": n_params, "loss": losses, "seconds_per_step": sec,
              "grad_check": [{"param": n, "index": list(i), "backward": a, "finite_difference": b, "rel_err": r}
                             for n, i, a, b, r, _ in fd]}
    detail = (f"loss {start:.3f} -> {end:.3f} (mean of last {k}; needs < {0.85 * start:.3f}), "
              f"{sum(ok for *_, ok in fd)}/{len(fd)} gradients agree with finite differences")
    lesson.finish("00_autograd", fell and fd_ok, [result], args, detail=detail)


if __name__ == "__main__":
    main()
