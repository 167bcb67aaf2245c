"""The ShallowSpeed workload (a NumPy + mpi4py peer) on pdist: ms/step per layout, equality with serial.

    python bench/mlp_peer.py                     # every configuration, both wait modes, 3 repeats
    python bench/mlp_peer.py --repeats 5 --steps 30

Workload: MLP [784, 128, 127, 126, 125, 124, 123, 10] (Linear + ReLU, cross-entropy), global
batch 128 cut into 4 micro-batches, SGD (lr 0.01); float32 for the timing. Configurations: 1 rank
(gradient accumulation over the 4 micro-batches), dp 2 (DataParallel, 64 rows per rank), pp 2
with GPipe and with 1F1B (PipelineParallel over the model's nn.Sequential: its 13 children are
the layers), dp 2 x pp 2 (DeviceMesh(dp=2, pp=2), DataParallel over PipelineParallel, both
schedules). Each runs under ``mpiexec`` with ``PDIST_COOPERATIVE_WAIT=0`` and ``=1``; the
configurations and modes are interleaved within each repeat, the table shows medians.

Equality: every configuration also trains 5 steps in float64 and compares every parameter
with the same 5 steps of serial training (one process, whole batch, no micro-batches);
"max |diff|" is the largest difference, ``equal`` means below 1e-12.

The peer's figures (ms/step, ShallowSpeed on this machine type: an Intel Xeon, 2 cores;
4-rank rows on 2 cores) are fixed reference numbers printed beside pdist's: ShallowSpeed is not
installed here. Its GPipe reuses one receive buffer for every micro-batch, so it is not equal to
serial training; pdist is compared with it anyway.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SIZES = [784, 128, 127, 126, 125, 124, 123, 10]
BATCH, MICRO, LR, CHECK_STEPS = 128, 4, 0.01, 5
# configuration -> (ranks, dp, pp, schedule, the peer's ms/step, the peer's row)
CONFIGS = {
    "1 rank": (1, 1, 1, None, 4.97, "1 rank"),
    "dp2": (2, 2, 1, None, 4.93, "dp 2"),
    "pp2 gpipe": (2, 1, 2, "gpipe", 3.81, "pp 2 GPipe*"),
    "pp2 1f1b": (2, 1, 2, "1f1b", 3.81, "pp 2 GPipe*"),
    "dp2xpp2 gpipe": (4, 2, 2, "gpipe", 8.64, "dp2xpp2 naive"),
    "dp2xpp2 1f1b": (4, 2, 2, "1f1b", 7.84, "dp2xpp2 GPipe*"),
}


def build(dtype):
    from pdist import nn
    from pdist.engine.functional import cross_entropy

    class MLP(nn.Sequential):
        """Linear + ReLU layers; ``model(x, y)`` -> (logits, loss) like the GPT (for Local)."""
        def forward(self, x, y=None):
            out = super().forward(x)
            return out if y is None else (out, cross_entropy(out, y))

    rng = np.random.default_rng(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b, rng=rng, dtype=dtype))
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return MLP(*layers), cross_entropy


def strategy(name, dtype):
    from pdist.comm import get_world
    from pdist.comm.mesh import DeviceMesh
    from pdist.parallel import DataParallel, Local, PipelineParallel
    from pdist.parallel.pipeline.stages import partition_layers
    _, dp, pp, schedule, _, _ = CONFIGS[name]
    model, ce = build(dtype)
    if pp == 1:
        s = Local(model, MICRO)
        return DataParallel(s, get_world()) if dp > 1 else s
    mesh = DeviceMesh(dp=dp, pp=pp)
    layers = list(model)
    spans = partition_layers(len(layers), pp)
    widths = [next((f.weight.shape[1] for f in reversed(layers[:a]) if hasattr(f, "weight")), SIZES[0])
              for a, _ in spans]                    # width of the activation entering stage k

    s = PipelineParallel(Local(model), mesh.pp_group, schedule, microbatches=MICRO, loss_fn=ce,
                         act_shape=lambda k, rows, x: (rows, widths[k]))
    return DataParallel(s, mesh.dp_group) if dp > 1 else s


def batch_fn(dtype):
    def get(step):
        rng = np.random.default_rng(1000 + step)
        return rng.standard_normal((BATCH, SIZES[0])).astype(dtype), rng.integers(0, SIZES[-1], BATCH)
    return get


def worker(a):
    from threadpoolctl import threadpool_limits
    from pdist import comm, optim
    from pdist.engine.backend import set_default_dtype
    from pdist.parallel import Local
    from pdist.training import train
    world = comm.init()
    threadpool_limits(limits=1)
    set_default_dtype("float64")                   # equality: float64 against serial training
    s = strategy(a.config, "float64")
    train(s, optim.SGD(s.parameters(), lr=LR), batch_fn("float64"), CHECK_STEPS)
    got = s.full_state_dict()
    ref = Local(build("float64")[0])
    train(ref, optim.SGD(ref.parameters(), lr=LR), batch_fn("float64"), CHECK_STEPS)
    diff = max(float(np.max(np.abs(got[n] - v))) for n, v in ref.module.state_dict().items())
    set_default_dtype("float32")                   # timing: float32, as the peer
    s = strategy(a.config, "float32")
    opt, times, clock = optim.SGD(s.parameters(), lr=LR), [], [0.0]
    get = batch_fn("float32")

    def batch(step):
        b = get(step)
        world.barrier()
        clock[0] = time.perf_counter()
        return b

    def on_step(step, loss):
        if step >= 3:
            times.append(time.perf_counter() - clock[0])
    train(s, opt, batch, 3 + a.steps, on_step=on_step)
    slowest = max(world.all_gather_object(statistics.median(times))) if world.size > 1 \
        else statistics.median(times)
    if world.rank == 0:
        print("RESULT " + json.dumps({"step": slowest, "diff": diff}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    from machine import header, record
    from pdist.course.lesson import table
    from pdist.testing import mpirun
    print(header("mlp_peer"))
    names = a.configs.split(",")
    res = {(n, w): [] for n in names for w in ("0", "1")}
    for rep in range(a.repeats):
        for n in names:
            for w in ("0", "1"):
                out = mpirun(CONFIGS[n][0], __file__, "--worker", "--config", n, "--steps", a.steps,
                             timeout=300, env={"PDIST_COOPERATIVE_WAIT": w})
                r = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
                res[n, w].append(r)
                print(f"  repeat {rep}: {n} coop={w}: {r['step'] * 1e3:.2f} ms/step", file=sys.stderr)
    rows, out = [], {}
    for n in names:
        ranks, _, _, _, peer, peer_row = CONFIGS[n]
        t0, t1 = (statistics.median(r["step"] for r in res[n, w]) * 1e3 for w in ("0", "1"))
        m0, m1 = (min(r["step"] for r in res[n, w]) * 1e3 for w in ("0", "1"))
        diff = max(r["diff"] for w in ("0", "1") for r in res[n, w])
        rows.append([n, ranks, f"{peer:.2f} ({peer_row})", f"{t0:.2f} ({m0:.2f})", f"{t1:.2f} ({m1:.2f})",
                     f"{min(t0, t1) / peer:.2f}x ({min(m0, m1) / peer:.2f}x)", f"{diff:.1e}",
                     "equal" if diff < 1e-12 else "DIFFERS"])
        out[n] = {"ranks": ranks, "peer_ms": peer, "coop0_ms": t0, "coop1_ms": t1, "coop0_min_ms": m0,
                  "coop1_min_ms": m1, "max_diff": diff,
                  "steps": {w: [r["step"] for r in res[n, w]] for w in ("0", "1")}}
    print(f"MLP {SIZES}, batch {BATCH}, {MICRO} micro-batches, SGD, float32, 1 BLAS thread per rank; "
          f"medians (min) of {a.repeats} repeats x {a.steps} steps (each: the slowest rank's median step)")
    print(table(rows, ["config", "ranks", "peer ms", "pdist ms coop=0", "coop=1", "better mode / peer",
                       "max |diff| (f64)", "vs serial"]))
    print("recorded:", record("mlp_peer", {"configs": out}))


if __name__ == "__main__":
    main()
