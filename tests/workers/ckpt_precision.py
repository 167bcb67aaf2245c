"""Mixed-precision checkpoints across layouts (tests/test_checkpoint.py), at 2 ranks.

    mpiexec -n 2 python tests/workers/ckpt_precision.py DIR

For bf16 and fp16: 2 AdamW steps under ZeRO-3 at dp 2, save DIR/<prec>; load it into
tensor parallelism at tp 2 and into one process (each rank alone), save each again as
DIR/<prec>-<layout> (the test compares the files: masters, m and v bit for bit) and
report the low-precision weights' distance from round(masters) and the scaler's state.
Then a float64 fp32 checkpoint (DIR/fp32) loads into a bf16 model: masters = fp32(saved)."""
import os
import sys

import numpy as np

from pdist import checkpoint, comm, data
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.models.gpt import GPT
from pdist.parallel import Local, ZeRO, parallelize
from pdist.parallel.mixed_precision import MixedPrecision
from pdist.engine.precision import cast_module, low_dtype
from pdist.testing import report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
d = sys.argv[1]
B, T, SEED = 8, 8, 3
tokens, _ = data.char_dataset(20_000)
cfg = lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=2, n_head=4, n_embd=32)

batch = data.batch_fn(tokens, B, T, SEED, cfg.vocab_size)


def rounding_gap(model):
    """max |w - round(W)| over this rank's tensors (0 when after_load re-derived w)."""
    dt = low_dtype(model.precision)
    return max(float(np.max(np.abs(to_numpy(w.data).astype(np.float64)
                                   - to_numpy(m.data).astype(dt).astype(np.float64))))
               for w, m in zip(model.low, model.masters))


for prec in ("bf16", "fp16"):
    z3 = MixedPrecision(ZeRO(cast_module(GPT(cfg, SEED), prec), 3, world), prec)
    opt = lesson.make_adamw(z3.parameters())
    train(z3, opt, batch, 2)
    checkpoint.save(z3, opt, os.path.join(d, prec), 2)
    saved_scaler = z3.scaler.state_dict() if z3.scaler is not None else None
    tp = parallelize(GPT(cfg, 99), comm.DeviceMesh(tp=2), precision=prec)
    local = MixedPrecision(Local(cast_module(GPT(cfg, 99), prec)), prec)
    for name, model in (("tp2", tp), ("local", local)):
        o = lesson.make_adamw(model.parameters())
        checkpoint.load(model, o, os.path.join(d, prec))
        if name == "local":
            if world.rank == 0:
                checkpoint.save(model, o, os.path.join(d, f"{prec}-{name}"), 2)
        else:
            checkpoint.save(model, o, os.path.join(d, f"{prec}-{name}"), 2)
        report(rank=world.rank, prec=prec, layout=name, gap=rounding_gap(model), saved_scaler=saved_scaler,
               scaler=model.scaler.state_dict() if model.scaler is not None else None)

fp32 = Local(GPT(cfg, SEED))
opt = lesson.make_adamw(fp32.parameters())
train(fp32, opt, batch, 1)
if world.rank == 0:
    checkpoint.save(fp32, opt, os.path.join(d, "fp32"), 1)
    bf = MixedPrecision(Local(cast_module(GPT(cfg, 99), "bf16")), "bf16")
    o = lesson.make_adamw(bf.parameters())
    checkpoint.load(bf, o, os.path.join(d, "fp32"))
    checkpoint.save(bf, o, os.path.join(d, "fp32-bf16"), 1)
    report(rank=0, prec="fp32", layout="bf16", gap=rounding_gap(bf), saved_scaler=None, scaler=None)
