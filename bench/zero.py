"""Step time of ZeRO stages 0-3 next to DDP, and stage 3 with and without prefetch.

    mpirun -n 2 python bench/zero.py                  # both sizes, 5 interleaved repeats
    mpirun -n 2 python bench/zero.py --sizes lesson --repeats 3 --steps 5
    mpirun -n 4 python bench/zero.py --rss            # RSS vs the formula, Ψ = 25.3 M, stages 0-3

One step of the one loop (pdist.training.train: forward + backward + AdamW) of a
float32 GPT, per-rank batch fixed (``rows`` per rank), for: DDP (pdist.parallel.data_parallel.DataParallel, bucketed
and overlapped), ZeRO stage 0 (zero.py's own data parallelism: one flat all-reduce
per unit), stages 1, 2, and 3 with and without all-gather prefetch, and stage 3 without its
buffer pool (every gather and full gradient a fresh mapping, as before the pool). Sizes:
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
included: lesson 03 puts them beside the formula), and the minor page faults per timed
step (getrusage's ru_minflt: pages mapped afresh; ZeRO-2/3 reuse their freed unit and
gradient buffers from a pool, host_memory.BufferPool, so a step after the first faults
few pages in; a count that load does not change, unlike the times).
"""
import argparse
import gc
import os
import resource
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
CONFIGS = ["DDP", "zero0", "zero1", "zero2", "zero3", "zero3 no prefetch", "zero3 no pool"]


def make_model(name, cfg, world):
    """The strategy of configuration ``name`` and its optimizer."""
    meta = gpt.GPT(cfg, seed=0, device="meta")     # each rank draws only what it holds (pdist/engine/meta.py)
    if name == "DDP":
        from pdist.parallel import DataParallel
        model = DataParallel(meta, world)
    else:
        model = ZeRO(meta, int(name[4]), world, prefetch="no prefetch" not in name)
        if "no pool" in name:      # every gather and full gradient in a fresh mapping (the pool's absence)
            for u in model.units:
                u.pool = None
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

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    train(model, opt, batch, steps, on_step=on_step, start=2)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    world.barrier()
    st = memory.model_state_bytes(model, opt)
    return statistics.median(times), sent[0], (sum(st.values()), rss.rss_bytes, rss.rss_peak_bytes, faults)


RSS_SIZE = dict(n_layer=8, n_head=8, n_embd=512)   # Ψ = 25.3 M with the corpus's 65 characters


def formula_bytes(stage, psi, n, b=4):
    """The stage's model states per rank (zero.py's table, Adam's m and v): 4bΨ, 2bΨ + 2bΨ/N,
    bΨ + 3bΨ/N, 4bΨ/N; Ψ here is Σ_units Ψ_pad at stages 1-3 (the unpadded Ψ at stage 0)."""
    return b * psi * (4, 2 + 2 / n, 1 + 3 / n, 4 / n)[stage]


def rss_row(cfg, stage, world, tokens, steps=2):
    """The documented path, ``parallelize(GPT(cfg, seed), DeviceMesh(dp=N), zero_stage=stage)``,
    one row per rank: this rank's {stage, rank, formula, built, rss, held, allocated, pool, base} in bytes,
    each RSS minus the RSS before the model (after malloc returned its free pages). built: just
    after parallelize; rss, held, allocated: after ``steps`` steps (memory.rss_split: held is
    what malloc and ZeRO's buffer pool keep free for the next step, allocated = rss - held; pool: the
    pool's part of held; base: the RSS before the model, the process's baseline)."""
    from pdist.comm.mesh import DeviceMesh
    from pdist.parallel.parallelize import parallelize
    n = world.size
    gc.collect()
    host_memory.malloc_trim()
    base = memory.rss_bytes()
    model = parallelize(gpt.GPT(cfg, seed=0), DeviceMesh(dp=n), zero_stage=stage)
    built = memory.rss_bytes() - base
    opt = lesson.make_adamw(model.parameters())
    batches = [data.get_batch(tokens, n, cfg.block_size, 0, s) for s in range(steps)]
    train(model, opt, lambda s: batches[s], steps)
    pool = host_memory.held_bytes()          # ZeRO's buffer pool alone (rss_split empties it)
    split = memory.rss_split()
    psi = model.numel_padded if stage else cfg.num_params()
    row = {"stage": stage, "rank": world.rank, "formula": formula_bytes(stage, psi, n), "built": built,
           "rss": split["rss_bytes"] - base, "held": split["rss_held_bytes"],
           "allocated": split["rss_allocated_bytes"] - base, "pool": pool, "base": base}
    del model, opt
    return row


def rss_table(cfg, world, tokens, stages=(0, 1, 2, 3)):
    """Every rank's rss_row at each stage (all ranks get them); rank 0 prints the table."""
    rows = []
    for s in stages:
        rows += world.all_gather_object(rss_row(cfg, s, world, tokens))
    if world.rank == 0:
        mib = (lambda v: f"{v / 2**20:.1f}")
        print(f"\nRSS on the documented path: Ψ = {cfg.num_params():,} float32, {world.size} ranks x 1 row "
              f"x T {cfg.block_size}; MiB above the RSS before the model, ratio to the formula")
        print(lesson.table([[r["stage"], r["rank"], mib(r["formula"]), f"{r['built'] / r['formula']:.3f}",
                             mib(r["rss"]), mib(r["held"]), mib(r["allocated"]),
                             f"{r['allocated'] / r['formula']:.3f}"] for r in rows],
                           ["stage", "rank", "formula", "built/f", "rss", "held", "allocated", "alloc/f"]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rss", action="store_true", help="instead of the timings: the RSS table of the "
                   "documented path at Ψ = 25.3 M, stages 0-3, one row per rank (run it on 4 ranks)")
    args = p.parse_args()
    world = comm.init()
    tokens, tok = data.char_dataset()
    if args.rss:
        rows = rss_table(lesson.gpt_config(tok.vocab_size, **RSS_SIZE), world, tokens)
        if world.rank == 0:
            from machine import report
            report("zero_rss", {"ranks": world.size, "rows": rows})
        return
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
                          f"{med / base:.2f}x", lesson.fmt_bytes(sent[c]), mib(0), mib(1), mib(2),
                          " ".join(f"{m[3]:.0f}" for m in mem[c])])
        print(f"\n{size}: Ψ = {psi:,} float32 params, {world.size} ranks x {rows} rows x "
              f"T {cfg.block_size}, median of {args.repeats} repeats x {args.steps} steps")
        print(lesson.table(table, ["config", "ms/step", "spread", "vs DDP", "sent/step/rank",
                                   "states MiB/rank", "rss MiB/rank", "rss peak MiB/rank", "faults/step/rank"]))
        from machine import report
        report(f"zero_{size}", {"ranks": world.size, "rows": table, "seconds": res})
        sys.stdout.flush()


if __name__ == "__main__":
    main()
