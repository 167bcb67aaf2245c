"""Straggler detector / simulated cluster worker (tests/test_debug.py).

    mpirun -n 4 python tests/workers/debug_worker.py detect "straggler:rank=2,slowdown=2" [steps]
    mpirun -n 4 python tests/workers/debug_worker.py layouts
Prints one ``report`` per rank 0."""
import sys
import time

import numpy as np

from pdist import comm, data
from pdist.faults import debug, inject
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.comm import topology
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, parallelize
from pdist.testing import report
from pdist.training import train


def setup(n_embd=64):
    set_default_dtype("float32")
    world = comm.init(timeout=60)
    tokens, tok = data.char_dataset()
    cfg = lesson.gpt_config(tok.vocab_size, n_embd=n_embd)
    batch = lambda s: data.get_batch(tokens, 16, cfg.block_size, 0, s)  # noqa: E731
    return world, cfg, batch


def detect(spec, steps):
    world, cfg, batch = setup()
    model = DataParallel(GPT(cfg, 0), world)
    opt = lesson.make_adamw(model.parameters())
    train(model, opt, batch, 2)                # warm-up
    inject.set(spec)
    debug.clear()
    train(model, opt, batch, steps, start=2)
    rep = debug.straggler_report(model, last=steps)
    if world.rank == 0:
        print(rep, flush=True)
        report(rank=rep.rank, cause=rep.cause, slowdown=rep.slowdown, phase=rep.phase)


def layouts(steps, rounds=3):
    """The two dp=2 x tp=2 placements on 2 simulated nodes, interleaved ``rounds`` times;
    per layout the fastest round's median step (load from other processes only adds)."""
    world, cfg, batch = setup()
    spec = "nodes={},intra=300GB/s:2us,inter=20MB/s:200us"
    out = {}
    for _ in range(rounds):
        for name, place in (("tp-in-node", "0+1/2+3"), ("tp-across", "0+2/1+3")):
            mesh = comm.DeviceMesh(dp=2, tp=2, topology=spec.format(place))
            model = parallelize(GPT(cfg, 0), mesh)
            opt = lesson.make_adamw(model.parameters())
            train(model, opt, batch, 1)
            for g in (mesh.tp_group, mesh.dp_group):
                g.reset_stats()
            times = []
            train(model, opt, batch, steps, on_step=lambda s, l: times.append(time.perf_counter()))
            pred = sum(s for _, s in topology.predict([mesh.tp_group, mesh.dp_group]).values()) / steps
            step_s = max(world.all_gather_object(float(np.median(np.diff(times)))))
            best = out.get(name, {}).get("step_s", float("inf"))
            out[name] = {"step_s": min(best, step_s), "pred_link_s": pred}
            topology.set(None)
    if world.rank == 0:
        report(**out)


if __name__ == "__main__":
    if sys.argv[1] == "detect":
        detect(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 8)
    else:
        layouts(int(sys.argv[2]) if len(sys.argv) > 2 else 6)
