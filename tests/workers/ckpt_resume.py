"""Checkpoints: save under one layout, load under others, resume (tests/test_checkpoint.py).

    mpiexec -n 4 python tests/workers/ckpt_resume.py save DIR --layout dp=2,tp=2,zero=1
    mpiexec -n 4 python tests/workers/ckpt_resume.py resume DIR --layout dp=4,zero=3 --layout pp=2,dp=2,mb=2

``save``: K AdamW steps (float64) through the one loop, a checkpoint after every step as
DIR/step-<n> with keep=3. ``resume``: for each layout, a fresh model and optimizer load
DIR/step-<k>, save it again as DIR/reloaded-<tag> (the test compares it with step-<k>:
the transfer must be exact), train K - k steps from step k and save DIR/resumed-<tag>
(the test compares it with step-<K>). A layout is ``dp=,tp=,pp=,zero=,sp=,mb=,schedule=``
(``rep=,shard=``: HSDP's dp_replicate and dp_shard),
``local`` (one process, no mesh) or ``plain`` (the GPT itself, no strategy). Reports JSON per layout.

    mpiexec -n 1 python tests/workers/ckpt_resume.py plain DIR
    mpiexec -n 2 python tests/workers/ckpt_resume.py transfer --copy tp=2 SRC DST

``plain``: a plain GPT trained k steps by hand (no strategy), saved as DIR. ``transfer``:
for each ``--copy LAYOUT SRC DST``, a fresh model in LAYOUT loads SRC and saves DST."""
import argparse
import os

from pdist import checkpoint, comm, data
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.optim import AdamW
from pdist.parallel import Local, parallelize
from pdist.testing import report
from pdist.training import train

p = argparse.ArgumentParser()
p.add_argument("phase", choices=["save", "resume", "plain", "transfer"])
p.add_argument("dir", nargs="?")
p.add_argument("--layout", action="append", default=[])
p.add_argument("--copy", nargs=3, action="append", default=[], metavar=("LAYOUT", "SRC", "DST"))
p.add_argument("--k", type=int, default=2)
p.add_argument("--K", type=int, default=4)
args = p.parse_args()
set_default_dtype("float64")
world = comm.init()
B, T, SEED = 8, 8, 3
tokens, _ = data.char_dataset(20_000)
cfg = lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=2, n_head=4, n_embd=32)

batch = data.batch_fn(tokens, B, T, SEED, cfg.vocab_size)


def build(spec):
    if spec == "local":
        return Local(GPT(cfg, SEED))
    if spec == "plain":                 # no strategy: the checkpoint treats it as one process
        return GPT(cfg, SEED)
    kw = dict(kv.split("=") for kv in spec.split(","))
    hybrid = {k: int(kw[a]) for k, a in (("dp_replicate", "rep"), ("dp_shard", "shard")) if a in kw}   # HSDP
    mesh = comm.DeviceMesh(dp=int(kw["dp"]) if "dp" in kw else None, tp=int(kw.get("tp", 1)),
                           pp=int(kw.get("pp", 1)), **hybrid)
    return parallelize(GPT(cfg, SEED), mesh, zero_stage=int(kw.get("zero", 0)),
                       sequence_parallel=bool(int(kw.get("sp", 0))),
                       microbatches=int(kw.get("mb", 1)), schedule=kw.get("schedule", "1f1b"))


def optimizer(model):
    return AdamW(model.parameters(), lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS,
                 weight_decay=lesson.WEIGHT_DECAY)


def tag(spec):
    return spec.replace(",", "_").replace("=", "")


if args.phase == "save":
    (spec,) = args.layout
    model = build(spec)
    opt = optimizer(model)

    def on_step(step, loss):
        checkpoint.save(model, opt, os.path.join(args.dir, f"step-{step + 1:06d}"), step + 1,
                        extra={"seed": SEED, "data_step": step + 1}, keep=3)
    losses = train(model, opt, batch, args.K, on_step=on_step)
    report(rank=world.rank, phase="save", layout=spec, losses=losses)
elif args.phase == "plain":
    model = build("plain")
    opt = optimizer(model)
    for s in range(args.k):
        _, loss = model(*batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(model, opt, args.dir, args.k, extra={"seed": SEED})
elif args.phase == "transfer":
    for spec, src, dst in args.copy:
        model = build(spec)
        opt = optimizer(model)
        step, extra = checkpoint.load(model, opt, src)
        checkpoint.save(model, opt, dst, step, extra=extra)
        report(rank=world.rank, phase="transfer", layout=spec, step=step)
else:
    src = os.path.join(args.dir, f"step-{args.k:06d}")
    for spec in args.layout:
        model = build(spec)
        opt = optimizer(model)
        if "pp=" not in spec:           # a forward first: ZeRO-1/2 then hold gathered (soon stale) params
            model(model.local_batch(*batch(0))[0])
        step, extra = checkpoint.load(model, opt, src)
        checkpoint.save(model, opt, os.path.join(args.dir, f"reloaded-{tag(spec)}"), step, extra=extra)
        losses = train(model, opt, batch, args.K - step, start=step)
        checkpoint.save(model, opt, os.path.join(args.dir, f"resumed-{tag(spec)}"), args.K, extra=extra)
        report(rank=world.rank, phase="resume", layout=spec, tag=tag(spec), step=step, extra=extra,
               losses=losses)
