"""The default mode's training step, this tree beside another revision's, in one run.

    python bench/default_step.py --base 46fe7ea            # both sizes, Local and DDP at 2 ranks
    python bench/default_step.py --base HEAD~3 --sizes lesson --repeats 9

What it times: one training step through the one shape, ``model.forward_backward(x, y)``
then AdamW's step and ``zero_grad`` (so the strategies' phases, their step hooks and the
engine's ops are all in it), float32, one BLAS thread per rank, at the lessons' size
(2 layers, n_embd 64, T 32, batch 16) and a large one (4 layers, n_embd 512, T 256, batch
8). Layouts: ``Local`` (one process) and bucketed DDP over 2 ranks (``mpiexec -n 2``).

How: the base revision is checked out once into a temporary git worktree (removed at the
end). Each repeat is a fresh process per tree (``PYTHONPATH`` the tree), base and this tree
alternating, so load from other processes hits both alike; a process warms up 3 steps and
reports the median of the next ``--steps``. The table gives the median over repeats of
each tree, the ratio this/base (<= 1.0: no slower) and the spread (max/min over repeats)
of each, as a noise gauge; the header says where it ran (bench/machine.py). A ratio inside
the spread is no difference. The JSON goes to bench/results/default_step.json.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = {"lesson": (dict(block_size=32, n_layer=2, n_head=4, n_embd=64), 16),
         "large": (dict(block_size=256, n_layer=4, n_head=8, n_embd=512), 8)}

WORKER = r'''
import statistics, sys, time
import numpy as np
from threadpoolctl import threadpool_limits
from pdist import comm, data
from pdist.course import lesson
from pdist.models.gpt import GPT, GPTConfig
from pdist.parallel import DataParallel, Local
size, B, steps, layout = eval(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = GPTConfig(vocab_size=96, dtype="float32", **size)
world = comm.init() if layout == "ddp" else None
model = Local(GPT(cfg, seed=0)) if layout == "local" else DataParallel(GPT(cfg, seed=0))
opt = lesson.make_adamw(model.parameters())
rng = np.random.default_rng(0)
x = rng.integers(0, 96, (B, cfg.block_size)); y = rng.integers(0, 96, (B, cfg.block_size))
times = []
with threadpool_limits(1):
    for i in range(3 + steps):
        t0 = time.perf_counter()
        loss = model.forward_backward(*model.local_batch(x, y), step=i)
        opt.step(); opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
if world is None or world.rank == 0:
    print("MEDIAN", statistics.median(times[3:]))
'''


def run(tree, size, B, steps, layout):
    """One fresh process (2 ranks for ddp) on ``tree``'s pdist: the median step, in seconds."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-c", WORKER, repr(size), str(B), str(steps), layout]
    if layout == "ddp":
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2"] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tree)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MEDIAN")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{tree} {layout}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(line.split()[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the revision to compare with (a commit, tag or branch)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--layouts", nargs="+", default=["local", "ddp"], choices=["local", "ddp"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    if a.repeats < 1 or a.steps < 1:
        p.error("--repeats and --steps must be >= 1")
    sys.path.insert(0, HERE)
    from machine import header, record
    from pdist.course.lesson import table
    base = tempfile.mkdtemp(prefix="pdist-base-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base, a.base], check=True, capture_output=True)
    rows, out = [], []
    try:
        print(header("default_step"))
        for size in a.sizes:
            for layout in a.layouts:
                cfg, B = SIZES[size]
                t = {"base": [], "this": []}
                for _ in range(a.repeats):                       # alternating: load hits both alike
                    t["base"].append(run(base, cfg, B, a.steps, layout))
                    t["this"].append(run(ROOT, cfg, B, a.steps, layout))
                med = {k: statistics.median(v) for k, v in t.items()}
                spread = {k: max(v) / min(v) for k, v in t.items()}
                ratio = med["this"] / med["base"]
                rows.append([size, layout, f"{med['base'] * 1e3:.2f}", f"{med['this'] * 1e3:.2f}", f"{ratio:.3f}",
                             f"{spread['base']:.2f}", f"{spread['this']:.2f}"])
                out.append({"size": size, "layout": layout, "base_ms": med["base"] * 1e3, "this_ms": med["this"] * 1e3,
                            "ratio": ratio, "spread_base": spread["base"], "spread_this": spread["this"],
                            "repeats": a.repeats, "steps": a.steps})
        print(f"base {a.base}; this tree; median over {a.repeats} alternating processes of each one's median "
              f"step (of {a.steps})")
        print(table(rows, ["size", "layout", "base ms", "this ms", "this/base", "spread base", "spread this"]))
        record("default_step", {"base": a.base, "rows": out})
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
