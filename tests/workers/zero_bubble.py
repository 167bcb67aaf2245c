"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) equal single-process training (float64).

    mpiexec -n 4 python tests/workers/zero_bubble.py

One launch runs every case of its world size (tests/test_zero_bubble.py lists them): a
case is (model, dp, tp, pp, zero, sp, schedule, m). For each, K AdamW steps through the
one training loop (``pdist.training.train``) on a ``parallelize``d model, the same global
batches as one process. Checked on every rank: the loss of every step and every piece of
every parameter and of Adam's m and v in ``sharded_state_dict`` against the same box of
the single-process tensors (rtol 1e-9, shard by shard); the split backward held memory
between B and W (``peak_held_w_bytes`` > 0) and left nothing behind, and the peak stash
per rank is the one ``check_schedule`` plans. Reported: one
JSON line per case and rank. Then the refusals: ZeRO-3 with a zero-bubble schedule, and
a V-shaped one with other than 2 chunks, raise on every rank before any collective.
"""
import numpy as np

from pdist import comm, data
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.models.gpt import GPT, GPTConfig
from pdist.models.llama import Llama, LlamaConfig
from pdist.optim import AdamW
from pdist.parallel import parallelize
from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel
from pdist.parallel.pipeline.schedules import make_schedule
from pdist.parallel.pipeline.simulate import check_schedule
from pdist.testing import report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
B, T, SEED, STEPS, TOL = 8, 8, 3, 2, dict(rtol=1e-9, atol=1e-12)
ZB = ("zb-h1", "zb-v", "dualpipev")
tokens, _ = data.char_dataset(20_000)
batch = data.batch_fn(tokens, B, T, SEED, 96)


def config(name, n_layer, recompute="none"):
    if name == "gpt2":
        return GPTConfig(vocab_size=96, block_size=T, n_layer=n_layer, n_head=2, n_embd=16, dtype="float64",
                         recompute=recompute)
    return LlamaConfig(vocab_size=96, block_size=T, n_layer=n_layer, n_head=2, n_kv_head=1, n_embd=16,
                       intermediate_size=32, dtype="float64", recompute=recompute)


def make(name, n_layer, recompute="none", device=None):
    return (GPT if name == "gpt2" else Llama)(config(name, n_layer, recompute), SEED, device=device)


def cases(n):
    """(model, dp, tp, pp, zero, sp, schedule, m, recompute or "meta") of this world size."""
    out = [(mod, 1, 1, n, 0, False, s, m) for s in ZB for m in (n, 2 * n) for mod in ("gpt2", "llama")]
    if n == 2:                                     # recompute: a checkpoint's inner backward split too
        out += [("gpt2", 1, 1, 2, 0, False, "zb-h1", 2, "selective"), ("llama", 1, 1, 2, 0, False, "zb-v", 2, "full"),
                ("gpt2", 1, 1, 2, 0, False, "zb-v", 2, "meta")]          # meta init: rank 0 draws both ends
    if n == 4:
        out += [(mod, 2, 1, 2, 0, False, s, 2) for s in ZB for mod in ("gpt2", "llama")]       # dp x pp
        out += [("gpt2", 1, 2, 2, 0, True, "zb-v", 2),                                          # tp(+SP) x pp
                ("llama", 2, 1, 2, 1, False, "zb-h1", 4), ("gpt2", 2, 1, 2, 2, False, "dualpipev", 2)]  # ZeRO-1/2
    return out


_refs, _meshes = {}, {}


def reference(name, n_layer):
    """One process: the losses, the state_dict and Adam's state by name (cached per model)."""
    if (name, n_layer) not in _refs:
        model = make(name, n_layer)
        opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            model.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        _refs[(name, n_layer)] = losses, model.state_dict(), {n: opt.state[id(q)] for n, q in model.named_parameters()}
    return _refs[(name, n_layer)]


def mesh_of(dp, tp, pp):
    if (dp, tp, pp) not in _meshes:
        _meshes[(dp, tp, pp)] = comm.DeviceMesh(dp=dp, tp=tp, pp=pp)
    return _meshes[(dp, tp, pp)]


def check(shards, ref_sd, ref_state, what):
    checked = 0
    for key, pieces in shards.items():
        if key.startswith("optimizer.step."):
            continue
        if key.startswith("optimizer."):
            _, state, name = key.split(".", 2)
            full = to_numpy(ref_state[name][state])
        else:
            full = to_numpy(ref_sd[key])
        for s in pieces:
            want = full[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.data.shape))]
            np.testing.assert_allclose(to_numpy(s.data), want, err_msg=f"{what}: {key} at {s.offsets}", **TOL)
            checked += 1
    return checked


def run(case):
    name, dp, tp, pp, zero, sp, sched, m, rc = case + ("none",) * (9 - len(case))
    what = f"{name} dp={dp} tp={tp} pp={pp} zero={zero} sp={sp} {sched} m={m}"
    what += "" if rc == "none" else " meta" if rc == "meta" else f" recompute={rc}"
    n_layer = 2 * pp                                     # V = 2p virtual stages for the V-shaped ones
    ref_losses, ref_sd, ref_state = reference(name, n_layer)
    mesh = mesh_of(dp, tp, pp)
    meta = rc == "meta"
    model = parallelize(make(name, n_layer, "none" if meta else rc, "meta" if meta else None), mesh, zero_stage=zero, sequence_parallel=sp, schedule=sched,
                        microbatches=m)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = train(model, opt, batch, STEPS)
    np.testing.assert_allclose(losses, ref_losses, err_msg=f"{what}: losses", **TOL)
    checked = check(model.sharded_state_dict(opt), ref_sd, ref_state, what)
    pipe = model.find(PipelineParallel)
    assert pipe.peak_held_w_bytes > 0 and pipe.peak_held_w >= 1 and not pipe._held_w, what
    assert not pipe._stash and not pipe._recvs and not pipe._grads, f"{what}: stash not freed"
    planned = check_schedule(make_schedule(sched, pp, m), m)[pipe.pp_rank]
    assert pipe.peak_stash == planned, f"{what}: stashed {pipe.peak_stash} (mb, chunk), the plan says {planned}"
    report(rank=world.rank, case=what, checked=checked, chunks=pipe.num_chunks, placement=pipe.placement,
           peak_stash=pipe.peak_stash, peak_held_w=pipe.peak_held_w, peak_held_w_bytes=pipe.peak_held_w_bytes)


def refusals(n):
    """Layouts that do not compose raise on every rank, naming what to change."""
    for kw, words in ((dict(zero_stage=3, schedule="zb-h1"), "ZeRO-3"),
                      (dict(chunks=3, schedule="zb-v"), "zb-v")):
        try:
            parallelize(make("gpt2", 2 * n), mesh_of(1, 1, n), microbatches=n, **kw)
            msg = None
        except ValueError as e:
            msg = str(e)
        assert msg is not None and words in msg, (kw, msg)
        report(rank=world.rank, refused=kw["schedule"], error=msg)


for c in cases(world.size):
    run(c)
refusals(world.size)
