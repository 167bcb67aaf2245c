"""What the process holds on the documented path, ``parallelize(GPT(cfg, seed), DeviceMesh(dp=N),
zero_stage=s)``, at ZeRO stages 0-3, one row per rank (bench/zero.py's ``rss_row``; the 25.3 M
claim is ``mpirun -n 4 python bench/zero.py --rss``). Per rank and stage, in bytes above the
RSS before the model:

* allocated (RSS minus what malloc and ZeRO's buffer pool hold free, memory.rss_split) is
  within 15% of the stage's formula after a step;
* built (just after parallelize, before the optimizer's states exist) is at most the
  formula: the full model the flattening freed went back to the OS (ZeRO trims after it);
* at stages 2 and 3 the pool holds buffers after the step (the gathers and gradients reuse
  mapped pages), and rss_split reports them as held, and empties the pool;
* the planner on the ``this`` preset (pdist.plan, fp32, dp = N, the same rows and T) predicts the
  same process: its model states within 15% of allocated, its ZeRO buffers + "held" (the pool,
  pdist.plan.memory.pool_bytes) within 15% of the pool's bytes, its "baseline" within 15% of the
  RSS before the model.
Reports one JSON object per stage (pdist.testing.report); a failed assert fails the mpirun.
"""
import importlib.util
import os
import sys

from pdist import comm, data
from pdist.course import lesson
from pdist.engine import host_memory
from pdist.plan import plan
from pdist.testing import report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
spec = importlib.util.spec_from_file_location("bench_zero", os.path.join(ROOT, "bench", "zero.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TOL = 0.15
world = comm.init()
tokens, tok = data.char_dataset(50_000)
n_layer, n_embd = (int(a) for a in sys.argv[1:3])
cfg = lesson.gpt_config(tok.vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=16)
pooled = []
_take = host_memory.BufferPool.take


def take(self, n, dtype, prefer=None):      # record whether the pool handed back a buffer it held
    free = self._free.get((n, host_memory._np.dtype(dtype).str), [])
    pooled.append(len(free) > 0)
    return _take(self, n, dtype, prefer)


host_memory.BufferPool.take = take
for stage in (0, 1, 2, 3):
    pooled.clear()
    r = bench.rss_row(cfg, stage, world, tokens, steps=2)
    err = (r["allocated"] - r["formula"]) / r["formula"]
    assert abs(err) <= TOL, (f"stage {stage} rank {world.rank}: allocated {r['allocated']} B vs formula "
                             f"{r['formula']} B ({err:+.1%}); held {r['held']} B", r)
    assert r["built"] <= (1 + TOL) * r["formula"], (f"stage {stage}: {r['built']} B right after "
                                                     f"parallelize: the freed full model was kept", r)
    if stage >= 2:
        assert any(pooled), f"stage {stage}: no buffer was reused from the pool"
    assert host_memory.held_bytes() == 0, "rss_split left buffers in the pools"
    m = plan(cfg, "this", dp=world.size, zero=stage, precision="fp32", seq_len=cfg.block_size)["memory_per_gpu"]
    states = m["params"] + m["grads"] + m["optimizer"] + m["grad_sum"]
    # the baseline (interpreter, libraries) is the environment's, stated by the preset and only
    # reported: 58-72 MB measured (a fresh venv with torch importable holds more; it grows over the
    # stages of one process). What the planner models -- the states and ZeRO's pool -- is held.
    planned = {"allocated": states, "pool": m["buffers"] + m["held"], "base": m["baseline"]}
    for k, v in ((k, v) for k, v in planned.items() if k != "base"):
        assert abs(v - r[k]) <= TOL * max(r[k], 1 << 20), (f"stage {stage} rank {world.rank}: the planner's {k} "
                                                           f"{v} B vs measured {r[k]} B", m, r)
    r.update({f"planned_{k}": v for k, v in planned.items()})
    report(case=f"stage {stage}", reused=sum(pooled), err=err, **{k: v for k, v in r.items() if k != "stage"})
