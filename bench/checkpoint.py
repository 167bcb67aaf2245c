"""Checkpoint save and load time beside the raw disk, for the same bytes.

    mpirun -n 2 python bench/checkpoint.py                     # 25.4 M parameters, float32
    mpirun -n 2 python bench/checkpoint.py --n-layer 2 --repeats 1

A float32 GPT (n_embd 512, 8 layers, Ψ = 25.4 M) at dp 2 ZeRO-1, its AdamW state filled
(m, v: every element written, as after a step), so each rank holds params + m + v of
half the model. Per repeat, interleaved:

* ``raw write+fsync``: each rank writes as many bytes as its rank file to its own file
  and fsyncs it (what the disk can do at best);
* ``save``: ``pdist.checkpoint.save`` into a new step directory (pieces -> safetensors,
  written from the arrays, sha256 while the pages are flushed, fsync, index, rename,
  fsync of the directory); deleting the previous checkpoint is not timed;
* ``raw read``: each rank reads its raw file back;
* ``load``: ``pdist.checkpoint.load`` into a fresh model of the same layout (checksums
  of every file, split over the ranks, and the pieces read memory-mapped); also
  ``checksums=False`` and into another layout (tp 2).

Times are the slowest rank's (every operation is collective: barrier, time, barrier).
"(disk)": the files' pages were dropped from the page cache first (posix_fadvise
DONTNEED), so the raw read and the load read the disk; "(cache)": read again right
after, from the page cache. Prints the conditions: cores, load average, date, command.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from pdist import checkpoint, comm  # noqa: E402
from pdist.course import lesson
from pdist.models.gpt import GPT  # noqa: E402
from pdist.optim import AdamW  # noqa: E402
from pdist.parallel import parallelize  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--n-layer", type=int, default=8)
ap.add_argument("--n-embd", type=int, default=512)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "pdist-bench-checkpoint"))
args = ap.parse_args()
world = comm.init()
me = world.rank
cfg = lesson.gpt_config(96, dtype="float32", block_size=64, n_layer=args.n_layer, n_head=8,
                        n_embd=args.n_embd)


def build(**layout):
    mesh = comm.DeviceMesh(**layout)
    model = parallelize(GPT(cfg, 0), mesh, zero_stage=1 if layout.get("dp", 1) > 1 else 0)
    return model, AdamW(model.parameters())


def timed(fn):
    os.sync()                      # start clean: no one pays for the previous step's writeback
    world.barrier()
    t0 = time.perf_counter()
    fn()
    dt = np.array([time.perf_counter() - t0])
    world.all_reduce(dt, op="max")
    return float(dt[0])


model, opt = build(dp=world.size)
rng = np.random.default_rng(me)
for t in model.parameters():
    opt.state[id(t)] = {"step": 1, "exp_avg": rng.standard_normal(t.data.shape).astype(t.data.dtype),
                        "exp_avg_sq": rng.random(t.data.shape).astype(t.data.dtype)}
ckpt, raw = os.path.join(args.dir, "step-000001"), os.path.join(args.dir, f"raw-{me}")
if me == 0:
    os.makedirs(args.dir, exist_ok=True)
world.barrier()
checkpoint.save(model, opt, ckpt, 1)                   # warm-up; also sizes the raw files
nbytes = os.path.getsize(os.path.join(ckpt, f"rank-{me:05d}.safetensors"))
total = np.array([float(nbytes)])
world.all_reduce(total)
blob = np.random.default_rng(1).bytes(nbytes)
fresh, fresh_opt = build(dp=world.size)
other, other_opt = build(tp=world.size)


def write_plain(path, data):
    """What the disk can do: one write of the same bytes, flush, fsync (no hashing)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def evict(*paths):
    """Drop these files' pages from the page cache (posix_fadvise DONTNEED; they are clean
    after fsync), so the next read comes from the disk."""
    for path in paths:
        for f in ([os.path.join(path, x) for x in os.listdir(path)] if os.path.isdir(path) else [path]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    world.barrier()


def read_raw():
    with open(raw, "rb") as f:
        while f.read(1 << 24):
            pass


names = ("raw write+fsync", "save", "raw read (disk)", "load (disk)", "raw read (cache)", "load (cache)",
         "load, checksums=False (cache)", "load into tp 2 (cache)")
runs = {k: [] for k in names}
for i in range(args.repeats):
    runs["raw write+fsync"].append(timed(lambda: write_plain(raw, blob)))
    new = os.path.join(args.dir, f"step-{i + 2:06d}")      # a new step directory, as training saves
    runs["save"].append(timed(lambda: checkpoint.save(model, opt, new, i + 2)))
    if me == 0:                                            # the previous one goes, outside the timing
        shutil.rmtree(ckpt)
    ckpt = new
    evict(raw, ckpt)
    runs["raw read (disk)"].append(timed(read_raw))
    runs["load (disk)"].append(timed(lambda: checkpoint.load(fresh, fresh_opt, ckpt)))
    runs["raw read (cache)"].append(timed(read_raw))
    runs["load (cache)"].append(timed(lambda: checkpoint.load(fresh, fresh_opt, ckpt)))
    runs["load, checksums=False (cache)"].append(
        timed(lambda: checkpoint.load(fresh, fresh_opt, ckpt, checksums=False)))
    runs["load into tp 2 (cache)"].append(timed(lambda: checkpoint.load(other, other_opt, ckpt)))
same = all(np.array_equal(a.view(a.tensor.data), b.view(b.tensor.data))
           for a, b in zip(model.pieces(), fresh.pieces()))
if me == 0:
    print(f"# bench/checkpoint.py  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  cores {os.cpu_count()}  "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# command: mpirun -n {world.size} python {' '.join(sys.argv)}")
    print(f"# model: Ψ = {cfg.num_params() / 1e6:.1f} M float32 at dp {world.size} ZeRO-1; checkpoint "
          f"{total[0] / 1e6:.1f} MB in {world.size} rank files (params + Adam m, v); "
          f"per rank {nbytes / 1e6:.1f} MB; disk {args.dir}; loaded == saved: {same}")
    print(f"{'operation':30s} {'median s':>9s} {'min s':>7s} {'GB/s (all ranks)':>17s}")
    for k, v in runs.items():
        med = statistics.median(v)
        print(f"{k:30s} {med:9.3f} {min(v):7.3f} {total[0] / med / 1e9:17.2f}")
    print("# every repeat, s:", {k: [round(x, 3) for x in v] for k, v in runs.items() if k in ("save", "raw write+fsync")})
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"save / raw write: {med['raw write+fsync'] / med['save']:.2f} of the raw speed; "
          f"load / raw read from disk: {med['raw read (disk)'] / med['load (disk)']:.2f}")
    from machine import report
    report("checkpoint", {"ranks": world.size, "seconds": runs, "bytes": total[0], "loaded_equal": same})
world.barrier()
if me == 0:
    shutil.rmtree(args.dir)
