"""Fingerprinted runs for tests/test_diverge.py, all in one 2-rank launch (float64, GPT 2 layers,
C 16, T 8, 4 AdamW steps, one global batch of 4 rows per step):

    mpiexec -n 2 python tests/workers/diverge_cases.py OUT_DIR

    OUT/local        one process (rank 0 alone), Local
    OUT/dp2, dp2b    data parallel over the 2 ranks, twice (the same layout: the same bits)
    OUT/tp2          tensor parallel over the 2 ranks (+SP)
    OUT/dp2_scaled   dp2, op PLANT's output scaled by 1 + 1e-7 on rank 1 at step 2
    OUT/dp2_splitk   dp2, op PLANT's K-sum computed as a quarter plus the rest on rank 1 at step 2 (a planted
                     reduction-order change: the same math, other bits)
    OUT/local_splitk one process, the K-sum as a quarter plus the rest at step 2 (a planted change on one rank)
    OUT/det_local, det_dp2   one process and dp2 in the deterministic mode (where it is built)
    OUT/det_dp2_splitk       dp2 in the deterministic mode, the split-K plant on rank 1 at step 2

Reports (pdist.testing.report) whether the planted split-K output really changed some bits.
"""
import os
import sys

from pdist import comm, data
from pdist.comm import DeviceMesh
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.measure import fingerprint
from pdist.models.gpt import GPT
from pdist.parallel import parallelize
from pdist.parallel.base import Local
from pdist.testing import report
from pdist.training import train

PLANT, PLANT_STEP, PLANT_RANK, STEPS, B = "transformer.h.1.mlp.c_proj", 2, 1, 4, 4
set_default_dtype("float64")
world = comm.init(timeout=60)
OUT = sys.argv[1]
tokens, tok = data.char_dataset(20_000)
cfg = lesson.gpt_config(96, dtype="float64", block_size=8, n_layer=2, n_head=2, n_embd=16)
changed = []


def plant(strategy, how, rank):
    """A forward hook on op PLANT that changes its output at PLANT_STEP on ``rank`` (in place:
    the backward reads the parents, so the graph stays; the later ops see the new values)."""
    def hook(module, args, out):
        if strategy.steps != PLANT_STEP or world.rank != rank:
            return None
        x, w = to_numpy(args[0].data), to_numpy(module.weight.data)       # (b, T, K), (K, N)
        if how == "scale":
            out.data[...] = out.data * (1 + 1e-7)
        else:
            h = x.shape[-1] // 4             # a quarter, not a half: the deterministic mode already sums halves
            y = x[..., :h] @ w[:h] + x[..., h:] @ w[h:]
            if module.bias is not None:
                y = y + to_numpy(module.bias.data)
            changed.append(int((y != out.data).sum()))
            out.data[...] = y
        return None
    mod = dict(strategy.find(Local).module.named_modules())[PLANT]
    mod.register_forward_hook(hook)


def run(name, layout, how=None, rank=PLANT_RANK, det=False):
    d = os.path.join(OUT, name)
    if world.rank == 0:
        os.makedirs(d, exist_ok=True)
    world.barrier()
    model = GPT(cfg, seed=1)
    if layout == "local":
        if world.rank != 0:
            return
        s = Local(model, **({"deterministic": det} if det else {}))
    else:
        mesh = DeviceMesh(**{layout: 2})
        s = parallelize(model, mesh, sequence_parallel=layout == "tp", **({"deterministic": det} if det else {}))
    if how:
        plant(s, how, rank)
    batch = data.batch_fn(tokens, B, cfg.block_size, 0, vocab_size=96)
    rank_kw = {"rank": 0, "world_size": 1} if layout == "local" else {}
    with fingerprint.record(s, d, **rank_kw):
        train(s, lesson.make_adamw(s.parameters()), batch, STEPS)


run("local", "local")
run("local_splitk", "local", "splitk", rank=0)
run("dp2", "dp")
run("dp2b", "dp")
run("tp2", "tp")
run("dp2_scaled", "dp", "scale")
run("dp2_splitk", "dp", "splitk")
run("det_local", "local", det=4)          # the mode of docs/deterministic.md: B = 4 granules of 1 row
run("det_dp2", "dp", det=4)
run("det_dp2_splitk", "dp", "splitk", det=4)
world.barrier()
report(rank=world.rank, changed=changed)
