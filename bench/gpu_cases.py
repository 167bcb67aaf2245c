"""The sizes, data and comparisons of bench/gpu_worker.py, and its training cases (steps c
and d): a layout, a big-activation pipeline or a mixed-precision DDP against one process on
the same global batches, each returning (ok, the first problem)."""
import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine import precision
from pdist.engine.backend import to_device, to_numpy
from pdist.models.gpt import GPT
from pdist.models.llama import LlamaConfig

B, T, SEED, STEPS, VOCAB = 8, 16, 3, 3, 96
TOL = dict(rtol=1e-9, atol=1e-12)
tokens, _ = data.char_dataset(20_000)
batch = data.batch_fn(tokens, B, T, SEED, VOCAB)


gpt_cfg = lambda n_layer=2: lesson.gpt_config(VOCAB, dtype="float64", block_size=T, n_layer=n_layer,  # noqa: E731
                                               n_head=4, n_embd=32)
llama_cfg = lambda: LlamaConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2,  # noqa: E731
                                n_embd=32, intermediate_size=48, dtype="float64")


def _close(name, got, want, **tol):
    """None when equal to ``tol``, else a line naming ``name`` and the largest difference."""
    got, want = to_numpy(got).astype(np.float64), to_numpy(want).astype(np.float64)
    if got.shape == want.shape and np.allclose(got, want, **(tol or TOL)):
        return None
    diff = np.abs(got - want).max() if got.shape == want.shape else f"shape {got.shape} vs {want.shape}"
    return f"{name}: max |diff| {diff}"


def _first(problems):
    """(ok, the first problem or "")."""
    problems = [p for p in problems if p]
    return (not problems, problems[0] if problems else "")


def _reference_run(make_model, microbatches=1, wrap=None):
    from pdist.parallel import Local
    from pdist.training import train
    ref = Local(make_model(), microbatches=microbatches)
    ref = wrap(ref) if wrap else ref
    opt = lesson.make_adamw(ref.parameters())
    return ref, opt, train(ref, opt, batch, STEPS)


def _compare(model, opt, ref, ref_opt, losses, ref_losses, tol):
    from pdist.testing import check_shards
    pieces = {pc.name: pc for pc in ref.pieces()}
    same = lambda a, b: np.allclose(a, b, **tol)  # noqa: E731
    probs = [_close("losses", np.array(losses), np.array(ref_losses), **tol)]
    try:
        check_shards(model.sharded_state_dict(opt), ref.full_state_dict(),
                     lambda n, s: ref_opt.state[id(pieces[n].tensor)][s], same)
    except AssertionError as e:
        probs.append(f"shard {e}")
    full, want = model.full_state_dict(), ref.full_state_dict()
    probs += [_close(k, full[k], want[k], **tol) for k in want]
    return probs


def _layout_case(n, mesh_kw, kw):
    from pdist.parallel import DataParallel, parallelize
    from pdist.training import train
    n_layer = max(2, n) if "pp" in mesh_kw else 2
    model = parallelize(GPT(gpt_cfg(n_layer), SEED), comm.DeviceMesh(**mesh_kw), **kw)
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, STEPS)
    ref, ref_opt, ref_losses = _reference_run(lambda: GPT(gpt_cfg(n_layer), SEED))
    probs = _compare(model, opt, ref, ref_opt, losses, ref_losses, TOL)
    if "bucket_cap_mb" in kw:
        nb = len(model.find(DataParallel).buckets)
        probs.insert(0, None if nb >= 8 else f"only {nb} buckets (want >= 8)")
        probs.append(f"{nb} buckets")
    ok, detail = _first(probs[:-1] if "bucket_cap_mb" in kw else probs)
    return ok, detail or (probs[-1] if "bucket_cap_mb" in kw else "")


def _big_pipeline_case(world, schedule, v, rows, width):
    """A pipeline of n v Linears whose activations (rows x width float64) exceed NCCL's buffer,
    so a lone send blocks until matched: it must finish, with one process's loss."""
    from pdist import nn
    from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel
    n, m = world.size, 2 * world.size
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((rows * m, width)), np.zeros((rows * m, width))

    def layers():
        nn.manual_seed(7)
        return [nn.Linear(width, width, bias=False) for _ in range(n * v)]
    ref = nn.mse_loss(nn.Sequential(*layers())(to_device(x)), to_device(y))
    pipe = PipelineParallel(nn.Sequential(*layers()), world, schedule, m, v,
                            act_shape=lambda k, rows_, x_: (rows_, width), loss_fn=nn.mse_loss)
    loss = pipe.forward_backward(*pipe.local_batch(x, y))
    return _first([_close("loss", np.array(loss), to_numpy(ref.data))])


def _precision_case(n, prec):
    from pdist.engine.grad_scaler import GradScaler
    from pdist.parallel import MixedPrecision, parallelize
    from pdist.training import train
    scaler = (lambda: GradScaler(init_scale=2.0 ** 8)) if prec == "fp16" else (lambda: None)
    model = parallelize(GPT(gpt_cfg(), SEED), comm.DeviceMesh(dp=n), precision=prec, scaler=scaler())
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, STEPS)
    ref, ref_opt, ref_losses = _reference_run(lambda: precision.cast_module(GPT(gpt_cfg(), SEED), prec),
                                              microbatches=n, wrap=lambda m: MixedPrecision(m, prec, scaler()))
    return _first(_compare(model, opt, ref, ref_opt, losses, ref_losses, dict(rtol=1e-6, atol=1e-9)))


