"""Lesson 11 -- the same bits on every layout: where two runs part, and a mode where they do not.

    mpirun -n 4 python lessons/11_same_bits.py        # dp 4 against dp 2 x tp 2
    mpirun -n 2 python lessons/11_same_bits.py        # dp 2 against tp 2
    python lessons/11_same_bits.py                    # one process: 1 against 2 micro-batches

Two layouts of one model train on the same global batches in float32. In exact arithmetic
they are one computation; in floating point every sum that a layout splits -- the batch sum
of a weight gradient over dp ranks or micro-batches, the K-sum of a row-parallel matmul over
tp ranks -- is added in another order, and (a + b) + c is not a + (b + c).

1. The default mode drifts. Every op's activation, output gradient and synchronized parameter
   gradient is fingerprinted each step (pdist.measure.fingerprint; docs/divergence.md); the
   table shows, step by step, how many tensors still hold identical bits and the largest
   relative difference. The bisector (pdist.faults.diverge; ``python -m pdist.debug diverge
   RUN_A RUN_B``) names the first op whose bits part (step 0, the first split sum) and the
   step k by which the drift passes --rtol. The losses still agree to float32's few ulps.
2. The deterministic mode (``parallelize(..., deterministic=True)``; docs/deterministic.md)
   sums every splittable reduction as one fixed tree over fixed granules, so both layouts give
   identical bits: the bisector finds nothing, the parameters are ``np.array_equal``. Its cost
   is the step-time ratio to the default mode, measured here on layout A (conditions printed).
   Where the mode refuses layout B (tensor parallelism, so far), the act prints the reason and
   compares A with dp n, 2 micro-batches and ZeRO-1 instead.
   Where the mode is not built yet the act says so and the lesson PASSes act 1.
"""
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

from pdist import data
from pdist.comm import DeviceMesh
from pdist.course import lesson
from pdist.engine.backend import synchronize
from pdist.faults.diverge import diverge, drift
from pdist.measure import fingerprint
from pdist.models.gpt import GPT
from pdist.parallel import parallelize
from pdist.parallel.base import Local
from pdist.training import train

VOCAB = 96        # the corpus' 85 characters padded to a multiple of the tp size (GPT-2 pads its vocabulary too)


def parse():
    p = lesson.parser(__doc__, steps=6, dtype="float32", batch_size=8, no_inject=(
        "lesson 11 compares two clean runs; a fault would be the divergence. To see the bisector name one, "
        "plant it as tests/workers/diverge_cases.py does"), n_layer=2, n_embd=32, block_size=16)
    p.add_argument("--rtol", type=float, default=1e-6,
                   help="the drift threshold of act 1: the step where a tensor's rel diff passes it (default %(default)g)")
    args = lesson.validate(p, p.parse_args())
    if not args.rtol > 0:
        p.error(f"--rtol {args.rtol} must be > 0 (act 1 also compares exactly, at rtol 0, by itself)")
    return p, args


def say(world, *a):
    if world.rank == 0:
        print(*a, flush=True)


def layouts(n):
    """(name, spec) of layouts A and B for a world of n ranks; a spec: DeviceMesh sizes, and
    ``microbatches``/``zero_stage`` (one process: a ``Local`` of that many micro-batches)."""
    if n == 1:
        return ("1 process", {"microbatches": 1}), ("1 process, 2 micro-batches", {"microbatches": 2})
    if n == 2:
        return ("dp 2", {"dp": 2}), ("tp 2", {"tp": 2})
    return (f"dp {n}", {"dp": n}), (f"dp {n // 2} x tp 2", {"dp": n // 2, "tp": 2})


def fallback(n):
    """Layout B of act 2 where the deterministic mode refuses act 1's: no tp, but the batch
    sums split otherwise (2 micro-batches; ZeRO-1's reduce-scatter)."""
    if n == 1:
        return layouts(1)[1]
    return f"dp {n}, 2 micro-batches, ZeRO-1", {"dp": n, "microbatches": 2, "zero_stage": 1}


def build(cfg, seed, spec, deterministic=False):
    """Layout ``spec``'s strategy; ``deterministic``: False, or the granule count G."""
    model, kw = GPT(cfg, seed=seed), {"deterministic": deterministic} if deterministic else {}
    spec = dict(spec)
    k, z = spec.pop("microbatches", 1), spec.pop("zero_stage", 0)
    if not spec:
        return Local(model, k, **kw)
    return parallelize(model, DeviceMesh(**spec), microbatches=k, zero_stage=z, **kw)


def run(world, cfg, args, spec, run_dir=None, deterministic=False, timed=False):
    """Train ``args.steps`` steps; (losses, full state dict, median step seconds)."""
    s = build(cfg, args.seed, spec, deterministic)
    opt, batch = lesson.make_adamw(s.parameters()), data.batch_fn(TOKENS[0], args.batch_size, cfg.block_size,
                                                                  args.seed, vocab_size=VOCAB)
    marks = []

    def mark(step, loss):
        synchronize()
        marks.append(time.perf_counter())
    if run_dir is not None:
        with fingerprint.record(s, run_dir):
            losses = train(s, opt, batch, args.steps)
    else:
        losses = train(s, opt, batch, args.steps, on_step=mark if timed else None)
    return losses, s.full_state_dict(), float(np.median(np.diff(marks))) if len(marks) > 2 else 0.0


def act_drift(world, cfg, args, root):
    (na, sa), (nb, sb) = layouts(world.size)
    say(world, f"\n== act 1: the default mode, {na} (A) against {nb} (B), {args.dtype}, {args.steps} steps")
    dirs = [os.path.join(root, k) for k in ("a", "b")]
    la, _, _ = run(world, cfg, args, sa, dirs[0])
    lb, _, _ = run(world, cfg, args, sb, dirs[1])
    world.barrier()
    rows = drift(*dirs) if world.rank == 0 else []
    first = diverge(*dirs, rtol=0) if world.rank == 0 else None
    late = diverge(*dirs, rtol=args.rtol) if world.rank == 0 else None
    say(world, lesson.table([[s, f"{same}/{n}", r, f"{k[1]} {k[2]}" if k else "-", la[s], lb[s]]
                             for s, same, n, r, k in rows],
                            ["step", "identical bits", "max rel diff", "where (op, tensor)", "loss A", "loss B"],
                            floatfmt="{:.3g}"))
    if world.rank == 0:
        print(f"bisector, exact (rtol 0): {first}")
        print(f"bisector, rtol {args.rtol:g}:    {late}")
    got = world.broadcast_object((first is not None and first.found, first and first.phase, first and first.op,
                                  late and late.step, first and first.step), src=0)
    rel = max(abs(a - b) / abs(a) for a, b in zip(la, lb))
    none_same = world.broadcast_object(next((s for s, same, _, _, _ in rows if same == 0), None), src=0)
    ok = bool(got[0]) and rel < 1e-4
    say(world, f"{'PASS' if ok else 'FAIL'}: act 1 -- the layouts' bits part at step {got[4]} in {got[1]} op {got[2]}"
               f"{'' if none_same is None else f'; by step {none_same} no tensor holds the same bits'}"
               f"{'' if got[3] is None else f', the drift passes rtol {args.rtol:g} at step {got[3]}'}; "
               f"the losses agree to {rel:.2g} (< 1e-4)")
    return ok, {"name": "default", "layouts": [na, nb], "loss": la, "baseline_loss": lb, "exact_step": got[4],
                "exact_phase": got[1], "exact_op": got[2], "drift_step": got[3], "rtol": args.rtol,
                "no_identical_step": none_same}


def conditions(world):
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{world.size} rank(s) on {os.cpu_count()} cores, load average {load:.1f}, {platform.processor() or platform.machine()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def act_same_bits(world, cfg, args, root):
    (na, sa), (nb, sb) = layouts(world.size)
    say(world, f"\n== act 2: the deterministic mode, {na} (A) against {nb} (B)")
    dirs = [os.path.join(root, k) for k in ("da", "db")]
    G = min(16, args.batch_size & -args.batch_size)     # granules: a power of two dividing the batch
    la, sda, _ = run(world, cfg, args, sa, dirs[0], deterministic=G)
    try:
        lb, sdb, _ = run(world, cfg, args, sb, dirs[1], deterministic=G)
    except ValueError as e:                               # a layout the mode refuses, with its reason
        (nb, sb) = fallback(world.size)
        say(world, f"the mode refuses B: {e}\n-> act 2 compares {na} with {nb} instead")
        lb, sdb, _ = run(world, cfg, args, sb, dirs[1], deterministic=G)
    world.barrier()
    d = diverge(*dirs, rtol=0) if world.rank == 0 else None
    say(world, f"bisector, exact: {d}")
    found = world.broadcast_object(d is not None and d.found, src=0)
    equal = la == lb and all(np.array_equal(sda[k], sdb[k]) for k in sda)
    rounds = [[run(world, cfg, args, sa, timed=True, deterministic=det)[2] for det in (False, G)] for _ in range(2)]
    times = [min(r[i] for r in rounds) for i in (0, 1)]       # the modes interleaved, twice: the less disturbed
    ratio = times[1] / times[0] if times[0] else float("nan")
    say(world, lesson.table([["default", times[0] * 1e3, 1.0], ["deterministic", times[1] * 1e3, ratio]],
                            ["mode", f"ms/step ({na})", "ratio"], floatfmt="{:.3g}"))
    say(world, f"(measured: {conditions(world)}; the smaller of 2 interleaved runs' median step of {args.steps}, no recording)")
    ok = equal and not found
    say(world, f"{'PASS' if ok else 'FAIL'}: act 2 -- deterministic mode: {na} and {nb} hold "
               f"{'identical' if equal else 'DIFFERENT'} parameters after {args.steps} steps, the bisector finds "
               f"{'a divergence' if found else 'nothing'}; cost {ratio:.2f}x the default step")
    return ok, {"name": "deterministic", "layouts": [na, nb], "identical": equal,
                "seconds_per_step": times[1], "baseline_seconds_per_step": times[0], "cost_ratio": ratio}


TOKENS = [None]


def main():
    parser, args = parse()
    world, tokens, tok = lesson.start(args)
    if world.size > 1 and (world.size & (world.size - 1)):
        parser.error(f"run it on 1, 2, 4 or 8 ranks (a power of two: dp and tp split the batch and the heads); "
                     f"got {world.size}")
    if args.batch_size % (2 * world.size):
        parser.error(f"--batch-size {args.batch_size} must divide by 2 x {world.size} ranks (the layouts' rows "
                     "and micro-batches)")
    TOKENS[0] = tokens
    cfg = lesson.gpt_config(VOCAB, dtype=args.dtype, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                            block_size=args.block_size)
    root = tempfile.mkdtemp(prefix="pdist-lesson11-") if world.rank == 0 else None
    root = world.broadcast_object(root, src=0)
    t0 = time.perf_counter()
    try:
        results = [act_drift(world, cfg, args, root), act_same_bits(world, cfg, args, root)]
    finally:
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(root, ignore_errors=True)          # the lesson's own fingerprints
    say(world, f"\n(both acts: {time.perf_counter() - t0:.1f} s)")
    oks = [ok for ok, _ in results]
    lesson.finish("11_same_bits", all(oks), [r for _, r in results], args, rank=world.rank, world_size=world.size,
                  detail="-- " + ", ".join(f"act {i + 1} {'PASS' if o else 'FAIL'}" for i, o in enumerate(oks)))


if __name__ == "__main__":
    sys.exit(main())
