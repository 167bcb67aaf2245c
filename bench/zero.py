"""Step time of ZeRO stages 0-3 next to DDP, and stage 3 with and without prefetch.

    mpirun -n 2 python bench/zero.py                  # both sizes, 5 interleaved repeats
    mpirun -n 2 python bench/zero.py --sizes lesson --repeats 3 --steps 5

One forward + backward + AdamW step of a float32 GPT, per-rank batch fixed
(``rows`` per rank), for: DDP (pdist.parallel.data_parallel.DataParallel, bucketed
and overlapped), ZeRO stage 0 (zero.py's own data parallelism: one flat all-reduce
per unit), stages 1, 2, and 3 with and without all-gather prefetch. Sizes:
``lesson`` is the lessons' GPT (2 layers, n_embd 64, T 32, 6 rows per rank: a few ms
of compute, so communication and hook overhead show); ``medium`` is 4 layers,
n_embd 256, T 64, 8 rows per rank (compute-heavier, 3.2 M parameters).

Each configuration builds its model, runs 2 warm-up steps, then ``--steps`` timed
steps; the configurations are interleaved within each repeat so that load from other
processes hits all of them alike. The table shows the median over repeats of each
run's median step time, the spread (max/min over repeats: a noise gauge), the ratio
to DDP, and the bytes each rank sent per step (ring accounting).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pdist import comm, data, gpt, lesson  # noqa: E402
from pdist.parallel.zero import ZeRO  # noqa: E402

SIZES = {"lesson": (dict(block_size=32, n_layer=2, n_head=4, n_embd=64), 6),
         "medium": (dict(block_size=64, n_layer=4, n_head=8, n_embd=256), 8)}
CONFIGS = ["DDP", "zero0", "zero1", "zero2", "zero3", "zero3 no prefetch"]


def make_step(name, cfg, world):
    """A function that runs one training step of configuration ``name``."""
    model = gpt.GPT(cfg, seed=0)
    if name == "DDP":
        from pdist.parallel.data_parallel import DataParallel
        dp = DataParallel(model, world)
        opt = lesson.make_adamw(dp.parameters())

        def step(x, y):
            dp.zero_grad()
            _, loss = dp(x, y)
            loss.backward()
            dp.finish_gradient_synchronization()
            opt.step()
        return step
    z = ZeRO(model, int(name[4]), world, prefetch="no prefetch" not in name)
    opt = lesson.make_adamw(z.parameters())

    def step(x, y):
        z.zero_grad()
        _, loss = z(x, y)
        loss.backward()
        z.step(opt)
    return step


def time_config(name, cfg, rows, world, tokens, steps):
    n, rank = world.size, world.rank
    step = make_step(name, cfg, world)
    batches = [data.shard(data.get_batch(tokens, rows * n, cfg.block_size, 0, s), rank, n)
               for s in range(steps + 2)]
    for x, y in batches[:2]:
        step(x, y)
    world.barrier()
    times = []
    for x, y in batches[2:]:
        world.reset_stats()
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
        sent = world.bytes_sent()
    world.barrier()
    return statistics.median(times), sent


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    world = comm.init()
    tokens, tok = data.char_dataset()
    configs = list(CONFIGS)
    try:
        import pdist.parallel.data_parallel  # noqa: F401
    except ImportError:
        configs.remove("DDP")
    for size in args.sizes:
        kw, rows = SIZES[size]
        cfg = lesson.gpt_config(tok.vocab_size, **kw)
        res = {c: [] for c in configs}
        sent = {}
        for _ in range(args.repeats):
            for c in configs:
                t, sent[c] = time_config(c, cfg, rows, world, tokens, args.steps)
                res[c].append(t)
        if world.rank != 0:
            continue
        psi = sum(p_.size for p_ in gpt.GPT(cfg).parameters())
        base = statistics.median(res["DDP"]) if "DDP" in res else statistics.median(res["zero0"])
        table = []
        for c in configs:
            med = statistics.median(res[c])
            table.append([c, f"{med * 1e3:.1f}", f"{max(res[c]) / min(res[c]):.2f}",
                          f"{med / base:.2f}x", lesson.fmt_bytes(sent[c])])
        print(f"\n{size}: Ψ = {psi:,} float32 params, {world.size} ranks x {rows} rows x "
              f"T {cfg.block_size}, median of {args.repeats} repeats x {args.steps} steps")
        print(lesson.table(table, ["config", "ms/step", "spread", "vs DDP", "sent/step/rank"]))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
