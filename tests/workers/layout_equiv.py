"""Each layout of the one shape equals single-process training (float64), for every model.

    mpiexec -n 8 python tests/workers/layout_equiv.py --dp 2 --tp 2 --pp 2 --zero 1 --sp --model gpt2,llama
    mpiexec -n 2 python tests/workers/layout_equiv.py "--each=--dp 2;--tp 2 --sp" --model gpt2,llama

For each model named by ``--model``: K AdamW steps through ``pdist.training.train`` (the
one loop) on the same global batches as one process. Checked on every rank, reported as
JSON (pdist.testing.report, one report per model): the loss of every step (rtol 1e-9),
every piece of every parameter and of Adam's m and v in ``sharded_state_dict`` against the
same box of the single-process tensors (rtol 1e-9: shard by shard), ``full_state_dict``
against the single-process state_dict, and ``load_full_state_dict`` of the reference
restoring it exactly.

``--each=A;B;...`` runs several layouts of this world size in one launch (one start-up of
mpiexec and the imports for all of them; the single-process reference of each model is
computed once per configuration). Each report then carries ``case`` (the layout's
arguments), and an error in a layout is re-raised naming it, so the job's failure message
(pdist.testing) says which layout and model failed, with that rank's traceback."""
import argparse

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine import meta
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.models.gpt import GPT
from pdist.models.llama import Llama, LlamaConfig
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.parallel.layout import box_slices
from pdist.testing import report
from pdist.training import train

p = argparse.ArgumentParser()
for k in ("dp", "tp", "pp", "zero", "microbatches", "chunks", "steps"):
    p.add_argument(f"--{k}", type=int, default={"microbatches": 1, "chunks": 1, "steps": 3, "zero": 0}.get(k, 1))
p.add_argument("--dp-replicate", type=int, default=None, help="HSDP: replicas (DeviceMesh dp_replicate)")
p.add_argument("--dp-shard", type=int, default=None, help="HSDP: ranks of a shard group (DeviceMesh dp_shard)")
p.add_argument("--sp", action="store_true")
p.add_argument("--schedule", default="1f1b")
p.add_argument("--naive", action="store_true")
p.add_argument("--meta", action="store_true", help="build the model on device='meta': each rank draws its pieces")
p.add_argument("--n-layer", type=int, default=4)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--model", default="gpt2", help="comma-separated: gpt2, llama")
p.add_argument("--each", default=None, help="several layouts, ';'-separated, each run in turn (one launch)")
ARGS = p.parse_args()
set_default_dtype("float64")
world = comm.init()
T, SEED, TOL = 8, 3, dict(rtol=1e-9, atol=1e-12)
tokens, tok = data.char_dataset(50_000)
MODELS = {"gpt2": GPT, "llama": Llama}
_REFERENCES = {}
CHUNK = meta.CHUNK_ELEMS        # put back at the end (a job after this one in tests/workers/jobs.py)


def config(name, args):
    if name == "gpt2":
        return lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=args.n_layer, n_head=4, n_embd=32)
    return LlamaConfig(vocab_size=96, block_size=T, n_layer=args.n_layer, n_head=4, n_kv_head=2, n_embd=32,
                       intermediate_size=48, dtype="float64")


def reference(name, args, batch):
    """Single-process training and its optimizer state, by name (computed once per
    model, depth, batch size and step count; nothing here writes to what it returns)."""
    key = (name, args.n_layer, args.batch_size, args.steps)
    if key in _REFERENCES:
        return _REFERENCES[key]
    model = MODELS[name](config(name, args), SEED)
    opt = AdamW(model.parameters(), lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS,
                weight_decay=lesson.WEIGHT_DECAY)
    losses = []
    for step in range(args.steps):
        x, y = batch(step)
        model.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    states = {n: opt.state[id(q)] for n, q in model.named_parameters()}
    _REFERENCES[key] = (losses, model.state_dict(), states)
    return _REFERENCES[key]


def check_shards(shards, ref_sd, ref_state, steps):
    """Every piece of every parameter and Adam state equals the same box of one process's."""
    checked = 0
    for key, pieces in shards.items():
        if key.startswith("optimizer.step."):
            assert all(int(to_numpy(s.data)) == steps for s in pieces), (key, pieces)
            continue
        if key.startswith("optimizer."):
            _, state, name = key.split(".", 2)
            full = to_numpy(ref_state[name][state])
        else:
            full = to_numpy(ref_sd[key])
        for s in pieces:
            assert tuple(s.global_shape) == full.shape, (key, s.global_shape, full.shape)
            want = full[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.data.shape))]
            np.testing.assert_allclose(to_numpy(s.data), want, err_msg=f"{key} at {s.offsets}", **TOL)
            checked += 1
    return checked


def check_full(model, shards, ref_sd, make):
    """full_state_dict is one process's; every element is held; load_full_state_dict inverts it."""
    covered = {k: 0 for k in ref_sd}
    for k, pieces in shards.items():
        if k in covered:
            covered[k] += sum(int(np.prod(s.data.shape)) for s in pieces)
    held = world.all_gather_object(covered)
    full = model.full_state_dict()
    assert sorted(full) == sorted(ref_sd), sorted(set(full) ^ set(ref_sd))
    for k in ref_sd:
        np.testing.assert_allclose(to_numpy(full[k]), to_numpy(ref_sd[k]), err_msg=k, **TOL)
        assert sum(h[k] for h in held) >= ref_sd[k].size, f"{k}: only {sum(h[k] for h in held)} elements held"
    init = make().state_dict()           # the inverse: load the initial weights back, every piece equals them
    model.load_full_state_dict(init)
    for pc in model.pieces():
        assert np.array_equal(to_numpy(pc.view(pc.tensor.data)), to_numpy(init[pc.name][box_slices(pc)])), pc
    again = model.full_state_dict()
    assert all(np.array_equal(to_numpy(again[k]), to_numpy(init[k])) for k in init)


def run(name, args, case):
    cfg, cls = config(name, args), MODELS[name]
    batch = data.batch_fn(tokens, args.batch_size, T, SEED, 96)
    hybrid = args.dp_replicate is not None or args.dp_shard is not None
    mesh = comm.DeviceMesh(dp=None if hybrid else args.dp, tp=args.tp, pp=args.pp, dp_replicate=args.dp_replicate,
                           dp_shard=args.dp_shard)
    meta.CHUNK_ELEMS = 37 if args.meta else CHUNK      # chunks that cut rows: the stream must still match
    model = parallelize(cls(cfg, SEED, device="meta" if args.meta else None), mesh, zero_stage=args.zero,
                        sequence_parallel=args.sp, schedule=args.schedule, microbatches=args.microbatches,
                        chunks=args.chunks, data_parallel="naive" if args.naive else "bucketed")
    opt = AdamW(model.parameters(), lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS,
                weight_decay=lesson.WEIGHT_DECAY)
    if args.meta:       # the materialized pieces are the same slices of the model built whole, to the bit
        init_sd = cls(cfg, SEED).state_dict()
        for pc in model.pieces():
            assert np.array_equal(to_numpy(pc.view(pc.tensor.data)), init_sd[pc.name][box_slices(pc)]), pc
    rows = len(model.local_batch(*batch(0))[0])
    B = args.batch_size
    assert rows == B // mesh.dp_world_size, f"this rank trains on {rows} rows of the global batch of {B}, want B/dp"
    losses = train(model, opt, batch, args.steps)
    ref_losses, ref_sd, ref_state = reference(name, args, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9, atol=0, err_msg=f"{name}: losses")
    shards = model.sharded_state_dict(opt)
    checked = check_shards(shards, ref_sd, ref_state, args.steps)
    check_full(model, shards, ref_sd, lambda: cls(cfg, SEED))
    report(rank=world.rank, model=name, case=case, coords=list(mesh.coords), layout=vars(args), steps=args.steps,
           checked_pieces=checked, losses=losses, chain=[type(s).__name__ for s in model.chain()])


def main():
    cases = [c.strip() for c in ARGS.each.split(";") if c.strip()] if ARGS.each is not None else [None]
    for case in cases:
        args = p.parse_args(case.split() + ["--model", ARGS.model]) if case is not None else ARGS
        for model_name in args.model.split(","):
            if case is None:
                run(model_name, args, case)
                continue
            try:
                run(model_name, args, case)
            except Exception as e:        # name the layout: the job's failure message shows this line
                raise AssertionError(f"layout {case!r}, model {model_name}: {type(e).__name__}: {e}") from e


try:
    main()
finally:
    meta.CHUNK_ELEMS = CHUNK
