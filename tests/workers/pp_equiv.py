"""Pipeline parallelism equals single-process training (float64, rtol 1e-9).

For every schedule (GPipe, 1F1B, interleaved v=2) and m in {1, p, 2p}: K AdamW
steps of the pipelined GPT on the global batch of each step, then every rank
compares each of its parameters with the same parameter of the single-process
model (lm_head.weight, the last stage's copy of the tied wte, against wte), and
the loss of every step with the single-process loss. Also: pipeline x data
parallel (p=2 x dp=2 on 4 ranks), an uneven partition, an nn.Sequential MLP,
the measured peak stash against the schedule's, freed stashes after the step,
and bad configs raising on every rank before any collective."""
import numpy as np

from pdist.engine.backend import to_device, to_numpy

from pdist import comm, data, nn
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.parallel import PipelineParallel, parallelize
from pdist.parallel.pipeline import schedules as S
from pdist.parallel.pipeline import simulate as sim
from pdist.parallel.layout import box_slices
from pdist.parallel.pipeline.stages import partition_layers
from pdist.testing import report
from pdist.training import train

set_default_dtype("float64")
K, B, SEED = 3, 8, 0
TOL = dict(rtol=1e-9, atol=1e-12)
world = comm.init()
n, rank = world.size, world.rank
tokens, tok = data.char_dataset()
_refs = {}


def config(n_layer):
    return lesson.gpt_config(tok.vocab_size, dtype="float64", n_layer=n_layer, n_embd=16, n_head=2, block_size=8)


def reference(cfg):
    if cfg.n_layer not in _refs:
        _refs[cfg.n_layer] = lesson.train_reference(cfg, SEED, K, B, tokens)
    return _refs[cfg.n_layer]


def pipe_of(model):
    return model.find(PipelineParallel)


def check_gpt(mesh, schedule, m, v=1, n_layer=None, partition=None):
    p, dp = mesh.pp_world_size, mesh.dp_world_size
    cfg = config(n_layer or p * v)
    ref_losses, ref_sd = reference(cfg)
    if dp > 1:   # pipeline x data parallel, composed by parallelize
        model = parallelize(GPT(cfg, SEED), mesh, schedule=schedule, microbatches=m, chunks=v)
    else:
        model = PipelineParallel(GPT(cfg, SEED), mesh.pp_group, schedule, m, v, partition=partition)
    pipe = pipe_of(model)
    opt = lesson.make_adamw(model.parameters())
    what = f"{schedule} p={p} dp={dp} m={m} v={v} partition={partition} (pp rank {mesh.pp_rank})"
    losses = train(model, opt, lambda step: data.get_batch(tokens, B, cfg.block_size, SEED, step), K)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9, atol=0, err_msg=what)
    assert not pipe._stash and not pipe._recvs and not pipe._grads, f"{what}: stash not freed"
    for pc in model.pieces():
        np.testing.assert_allclose(to_numpy(pc.view(pc.tensor.data)), to_numpy(ref_sd[pc.name][box_slices(pc)]),
                                   err_msg=f"{what}: {pc.name}", **TOL)
    # every parameter of the model lives on exactly one stage (wte also as lm_head on the last)
    names = mesh.pp_group.all_gather_object(sorted(n for n, _ in model.module.named_parameters()))
    held = sorted(k for ks in names for k in ks)
    want = sorted(cfg.param_shapes()) + (["lm_head.weight"] if p > 1 else [])
    assert held == sorted(want), f"{what}: stages hold {held}"
    planned = sim.check_schedule(S.make_schedule(schedule, p, m, v), m)[mesh.pp_rank]
    assert pipe.peak_stash == planned, f"{what}: stashed {pipe.peak_stash} micro-batches, plan says {planned}"
    if schedule == "gpipe":
        assert pipe.peak_stash == m
    if schedule == "1f1b":
        assert pipe.peak_stash <= p - mesh.pp_rank
    return what


def check_sequential(pg):
    """An nn.Sequential MLP, uneven split, 1F1B, mse loss, vs single-process training."""
    H, p, m = 12, pg.size, 4
    layers = 2 * p + 1
    partition = [layers - (p - 1)] + [1] * (p - 1)           # uneven: everything but p-1 layers on stage 0

    def build():
        nn.manual_seed(7)
        mods = [nn.Linear(5, H), nn.GELU()] + [nn.Linear(H, H) if i % 2 == 0 else nn.GELU()
                                             for i in range(layers - 3)] + [nn.Linear(H, 3)]
        return nn.Sequential(*mods)
    full = build()
    opt = lesson.make_adamw(full.parameters())
    pipe = PipelineParallel(build(), pg, "1f1b", m, partition=partition, act_shape=lambda k, rows, x: (rows, H),
                            loss_fn=nn.mse_loss)
    popt = lesson.make_adamw(pipe.parameters())
    for step in range(K):
        x, y = data.regression_batch(B, 5, 3, SEED, step)
        loss = nn.mse_loss(full(to_device(x)), to_device(y))
        full.zero_grad()
        loss.backward()
        opt.step()
        got = train(pipe, popt, lambda s: (x, y), 1)[0]
        assert np.isclose(got, loss.item(), rtol=1e-9), (got, loss.item())
    a, b = partition_layers(layers, p, partition)[pg.rank]
    ref = full.state_dict()
    for name, arr in pipe.module.state_dict().items():
        assert a <= int(name.split(".")[0]) < b
        np.testing.assert_allclose(to_numpy(arr), to_numpy(ref[name]), err_msg=f"sequential {name}", **TOL)


def expect_error(fn, words):
    try:
        fn()
    except ValueError as e:
        assert all(w in str(e) for w in words), f"unhelpful error: {e}"
        return
    raise AssertionError(f"no error raised (expected one mentioning {words})")


def check_errors(pg):
    p = pg.size
    if p > 1:
        expect_error(lambda: PipelineParallel(GPT(config(p - 1), SEED), pg, microbatches=2), ["stages", "layers"])
    expect_error(lambda: PipelineParallel(GPT(config(p), SEED), pg, "interleaved", 2, chunks=2), ["stages", "layers"])
    expect_error(lambda: PipelineParallel(GPT(config(p), SEED), pg, "zigzag", 2), ["unknown pipeline schedule"])
    expect_error(lambda: PipelineParallel(GPT(config(2 * p), SEED), pg, microbatches=2, partition=[1] * p),
                 ["partition"])
    pipe = PipelineParallel(GPT(config(p), SEED), pg, microbatches=3)
    x, y = data.get_batch(tokens, B, 8, SEED, 0)
    expect_error(lambda: pipe.local_batch(x, y), ["divisible", "micro-batches"])
    pg.barrier()                                                # nobody was left inside a collective


cases = []
if n in (1, 2):
    mesh = comm.DeviceMesh(pp=n)
    check_errors(mesh.pp_group)
    for schedule in ("gpipe", "1f1b", "interleaved"):
        for m in sorted({1, n, 2 * n}):
            cases.append(check_gpt(mesh, schedule, m, 2 if schedule == "interleaved" else 1))
    cases.append(check_gpt(mesh, "1f1b", 2 * n, n_layer=5, partition=[4, 1][:n] if n == 2 else None))
    check_sequential(mesh.pp_group)
    cases.append("sequential MLP 1f1b uneven")
if n == 4:
    mesh = comm.DeviceMesh(pp=4)
    check_errors(mesh.pp_group)
    for schedule in ("gpipe", "1f1b", "interleaved"):
        for m in (1, 4, 8):
            cases.append(check_gpt(mesh, schedule, m, 2 if schedule == "interleaved" else 1))
    mesh = comm.DeviceMesh(dp=2, pp=2)
    for schedule in ("gpipe", "1f1b", "interleaved"):
        for m in (1, 2, 4):
            cases.append(check_gpt(mesh, schedule, m, 2 if schedule == "interleaved" else 1))
if rank == 0:
    report(n=n, cases=cases)
