"""Step time of ZeRO stages 0-3 next to DDP, and stage 3 with and without prefetch.

    mpirun -n 2 python bench/zero.py                  # both sizes, 5 interleaved repeats
    mpirun -n 2 python bench/zero.py --sizes lesson --repeats 3 --steps 5

One step of the one loop (pdist.training.train: forward + backward + AdamW) of a
float32 GPT, per-rank batch fixed (``rows`` per rank), for: DDP (pdist.parallel.data_parallel.DataParallel, bucketed
and overlapped), ZeRO stage 0 (zero.py's own data parallelism: one flat all-reduce
per unit), stages 1, 2, and 3 with and without all-gather prefetch. Sizes:
``lesson`` is the lessons' GPT (2 layers, n_embd 64, T 32, 6 rows per rank: a few ms
of compute, so communication and hook overhead show); ``medium`` is 4 layers,
n_embd 256, T 64, 8 rows per rank (compute-heavier, 3.2 M parameters).

Each configuration builds its model, runs 2 warm-up steps, then ``--steps`` timed
steps; the configurations are interleaved within each repeat so that load from other
processes hits all of them alike. The table shows the median over repeats of each
run's median step time, the spread (max/min over repeats: a noise gauge), the ratio
to DDP, the bytes each rank sent per step (ring accounting), and per rank (in rank
order, MiB, the last repeat): the model states (pdist.measure.memory), the process's RSS after
the last timed step and its peak during that step (the interpreter and libraries
included: lesson 03 puts them beside the formula).
"""
import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pdist.engine import host_memory  # noqa: E402
from pdist import comm, data
from pdist.models import gpt
from pdist.course import lesson
from pdist.measure import memory
from pdist.engine.backend import synchronize  # noqa: E402
from pdist.parallel import ZeRO  # noqa: E402
from pdist.training import train  # noqa: E402

SIZES = {"lesson": (dict(block_size=32, n_layer=2, n_head=4, n_embd=64), 6),
         "medium": (dict(block_size=64, n_layer=4, n_head=8, n_embd=256), 8)}
CONFIGS = ["DDP", "zero0", "zero1", "zero2", "zero3", "zero3 no prefetch"]


def make_model(name, cfg, world):
    """The strategy of configuration ``name`` and its optimizer."""
    meta = gpt.GPT(cfg, seed=0, device="meta")     # each rank draws only what it holds (pdist/engine/meta.py)
    if name == "DDP":
        from pdist.parallel import DataParallel
        model = DataParallel(meta, world)
    else:
        model = ZeRO(meta, int(name[4]), world, prefetch="no prefetch" not in name)
    return model, lesson.make_adamw(model.parameters())


def time_config(name, cfg, rows, world, tokens, steps):
    """2 warm-up steps, then ``steps`` timed steps of the one loop (pdist.training.train):
    (median seconds per step, bytes this rank sent in the last step, memory: model states,
    RSS after the last step and its peak during that step)."""
    n = world.size
    gc.collect()
    host_memory.malloc_trim()      # the previous configuration's free pages back to the OS
    model, opt = make_model(name, cfg, world)
    rss = memory.StepRSS()
    batches = [data.get_batch(tokens, rows * n, cfg.block_size, 0, s) for s in range(steps + 2)]
    train(model, opt, lambda s: batches[s], 2)
    world.barrier()
    times, sent, clock = [], [0], [0.0]

    def batch(s):
        world.reset_stats()
        rss.start()
        clock[0] = time.perf_counter()
        return batches[s]

    def on_step(s, loss):
        synchronize()  # the step's device work is done (no-op on CPU)
        times.append(time.perf_counter() - clock[0])
        rss.stop()
        sent[0] = world.bytes_sent()

    train(model, opt, batch, steps, on_step=on_step, start=2)
    world.barrier()
    st = memory.model_state_bytes(model, opt)
    return statistics.median(times), sent[0], (sum(st.values()), rss.rss_bytes, rss.rss_peak_bytes)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    world = comm.init()
    tokens, tok = data.char_dataset()
    configs = list(CONFIGS)
    for size in args.sizes:
        kw, rows = SIZES[size]
        cfg = lesson.gpt_config(tok.vocab_size, **kw)
        res = {c: [] for c in configs}
        sent, mem = {}, {}
        for _ in range(args.repeats):
            for c in configs:
                t, sent[c], mine = time_config(c, cfg, rows, world, tokens, args.steps)
                mem[c] = world.all_gather_object(mine)        # every rank's (states, rss, rss peak)
                res[c].append(t)
        if world.rank != 0:
            continue
        psi = sum(p_.size for p_ in gpt.GPT(cfg).parameters())
        base = statistics.median(res["DDP"]) if "DDP" in res else statistics.median(res["zero0"])
        table = []
        for c in configs:
            med = statistics.median(res[c])
            mib = (lambda i: " ".join(f"{(m[i] or 0) / 2**20:.0f}" for m in mem[c]))
            table.append([c, f"{med * 1e3:.1f}", f"{max(res[c]) / min(res[c]):.2f}",
                          f"{med / base:.2f}x", lesson.fmt_bytes(sent[c]), mib(0), mib(1), mib(2)])
        print(f"\n{size}: Ψ = {psi:,} float32 params, {world.size} ranks x {rows} rows x "
              f"T {cfg.block_size}, median of {args.repeats} repeats x {args.steps} steps")
        print(lesson.table(table, ["config", "ms/step", "spread", "vs DDP", "sent/step/rank",
                                   "states MiB/rank", "rss MiB/rank", "rss peak MiB/rank"]))
        from machine import report
        report(f"zero_{size}", {"ranks": world.size, "rows": table, "seconds": res})
        sys.stdout.flush()


if __name__ == "__main__":
    main()
