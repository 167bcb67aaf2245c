"""Waterfall worker (tests/test_waterfall.py): every lesson layout of one world size in one launch.

    mpirun -n 2 python tests/workers/waterfall_worker.py 2      # dp, dp + recompute, zero-1, zero-3, tp, pp
    mpirun -n 4 python tests/workers/waterfall_worker.py 4      # mesh dp2 x tp2 (zero-1, sp), dp2 x pp2;
                                                                # the detector under DDP overlap

Per layout: a few steps timed by the Waterfall (start/stop around local_batch, forward_backward
and the optimizer step) and by an independent clock inside; per rank, per step after the first:
the sum of the parts over the independent step, the parts but the remainder over it. Rank 0
prints one ``report`` with {layout: [per rank: {"ratio", "measured", "parts"}]}.
"""
import contextlib
import sys
import time

from pdist import comm, data
from pdist.course import lesson
from pdist.engine.backend import set_default_dtype
from pdist.faults import debug, inject
from pdist.engine import hooks
from pdist.measure import waterfall
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, parallelize
from pdist.testing import report
from pdist.training import train

STEPS = 4
LAYOUTS = {2: {"dp": ({"dp": 2}, {}), "dp-recompute": ({"dp": 2}, {"recompute": "full"}),
               "zero-1": ({"dp": 2}, {"zero_stage": 1}), "zero-3": ({"dp": 2}, {"zero_stage": 3}),
               "tp": ({"tp": 2}, {}), "pp": ({"pp": 2}, {"microbatches": 4})},
           4: {"mesh-dp-tp": ({"dp": 2, "tp": 2}, {"zero_stage": 1, "sequence_parallel": True}),
               "mesh-dp-pp": ({"dp": 2, "pp": 2}, {"microbatches": 2})}}


def one_layout(world, tokens, vocab, axes, kw):
    recompute = kw.pop("recompute", "none")
    cfg = lesson.gpt_config(vocab, n_layer=2, n_head=2, n_embd=32, block_size=16, recompute=recompute)
    model = parallelize(GPT(cfg, 0), comm.DeviceMesh(**axes), **kw)
    opt = lesson.make_adamw(model.parameters())
    wf = waterfall.Waterfall(model)
    steps = []
    for s in range(STEPS):
        wf.start()
        t0 = time.perf_counter()
        x, y = model.local_batch(*data.get_batch(tokens, 8, cfg.block_size, 0, s))
        model.forward_backward(x, y)
        opt.step()
        opt.zero_grad()
        t = time.perf_counter() - t0
        parts = wf.stop()
        rest = sum(v for k, v in parts.items() if k != waterfall.OVERHEAD)
        steps.append({"ratio": sum(parts.values()) / t, "measured": rest / t, "parts": parts, "step": t})
    wf.close()
    return steps[1:]


class SlowForward(hooks.StepHook):
    """A throttled device inside the step: rank 2's every forward lasts 5x and 20 ms more (its
    buckets go out late)."""
    order = 10

    @contextlib.contextmanager
    def _slow(self):
        t = time.perf_counter()
        yield
        time.sleep(0.02 + 4 * (time.perf_counter() - t))       # well above the noise of shared cores

    def span(self, name, **args):
        return self._slow() if name == "forward" and comm.get_world().rank == 2 else None


def detector(world, tokens, vocab, fault):
    """Bucketed DDP (12 buckets overlapping backward), rank 2 slowed 3x by ``fault``: the
    injector's straggler (a sleep after its compute) or SlowForward; the detector's verdict."""
    cfg = lesson.gpt_config(vocab, n_layer=2, n_head=4, n_embd=64, block_size=32)
    model = DataParallel(GPT(cfg, 0), world, bucket_cap_mb=0.05, first_bucket_cap_mb=0.01)
    opt = lesson.make_adamw(model.parameters())
    batch = lambda s: data.get_batch(tokens, 16, cfg.block_size, 0, s)  # noqa: E731
    train(model, opt, batch, 1)
    slow = SlowForward() if fault == "forward" else None
    hooks.subscribe(slow) if slow else inject.set("straggler:rank=2,slowdown=3")
    debug.clear()
    wf = waterfall.Waterfall(auto=True)          # times each forward_backward
    train(model, opt, batch, 7, start=1)
    hooks.unsubscribe(slow) if slow else inject.clear()
    rep = debug.straggler_report(model, last=7)
    text = wf.table()                            # collective: resolves the steps
    parts = [s for s in world.all_gather_object(wf.summary()) for s in s.values()]
    wf.close()
    if world.rank == 0:
        print(rep, text, sep="\n", flush=True)
    return {"rank": rep.rank, "cause": rep.cause, "late": rep.late, "buckets": len(model.buckets), "text": rep.text,
            "parts": [p["parts"] for p in parts]}


def main(n):
    set_default_dtype("float64")
    world = comm.init(timeout=60)
    if world.size != n:
        sys.exit(f"waterfall_worker: launched on {world.size} ranks, asked for {n}")
    tokens, tok = data.char_dataset()
    out = {}
    for name, (axes, kw) in LAYOUTS[n].items():
        out[name] = world.gather_object(one_layout(world, tokens, tok.vocab_size, axes, dict(kw)))
    if n == 4:
        out["detector"] = {f: detector(world, tokens, tok.vocab_size, f) for f in ("inject", "forward")}
    cpu = world.gather_object(time.process_time())      # the CPU seconds this launch costs (the suite's budget)
    if world.rank == 0:
        report(**out, cpu_s=sum(cpu))


if __name__ == "__main__":
    main(int(sys.argv[1]))
