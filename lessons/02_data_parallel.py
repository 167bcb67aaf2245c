"""Lesson 02 -- data parallelism: n replicas, n slices of one global batch, one all-reduce.

    python lessons/02_data_parallel.py                 # 1 rank
    mpirun -n 4 python lessons/02_data_parallel.py     # 4 ranks (or -n 2)
    mpirun -n 2 python lessons/02_data_parallel.py --accum 2 --steps 10 --json dp.json
    mpirun -n 4 python lessons/02_data_parallel.py --precision bf16   # bf16 grads on the wire, fp32 masters

With ``--precision bf16`` (or fp16) the parameters and gradients are 2 bytes, the all-reduce
sends half the bytes, and the check compares with one process holding n micro-batches in
the same precision, bit for bit (docs/mixed_precision.md; with --accum > 1: float32's tolerance).

Each rank holds the whole GPT and takes rows [r B/n, (r+1) B/n) of the global batch
of every step (``model.local_batch``). Its loss is the mean over its rows, so
averaging the n gradients (all-reduce, op="avg") gives the gradient of the mean over
the global batch: the update single-process training makes. Two ways to average
(pdist/parallel/data_parallel.py):

* DataParallelNaive: after backward, one all-reduce per parameter.
* DataParallel: gradients in flat buckets; a bucket's all-reduce starts during
  backward, as soon as its last gradient is ready, and overlaps the rest of backward.

Both are strategies of the one shape, trained by the one loop (pdist.training.train):

    model = DataParallel(Local(GPT(cfg, seed), microbatches=k), world, bucket_cap_mb=0.25)
    opt = lesson.make_adamw(model.parameters())
    train(model, opt, lambda step: data.get_batch(tokens, B, T, seed, step), steps)

``--accum k`` is the one loop's micro-batches: each step runs k forward/backward
passes of B/(n k) rows each (gradient accumulation, each loss scaled by 1/k); the
buckets' all-reduces start during the last pass's backward.

The lesson trains both for --steps AdamW steps beside single-process training on the
same global batches and prints: the loss per step (1 process vs naive vs bucketed),
the bytes each rank all-reduces per step next to 2(n-1)/n * Psi * bytes, and the step
time split into compute and time spent waiting on communication, and each rank's memory:
model states (pdist.measure.memory) beside params + grads + Adam m, v = 4bΨ, and what the process
holds (rss, rss peak; lesson 03 explains them). PASS means: all replicas are bitwise
identical after every run, and over the first min(--steps, 10) steps every
rank's parameters and the losses equal single-process training: float64 to rtol
1e-9; float32 to rtol 1e-5 for the losses and 2e-4 absolute for the parameters
(in float32, AdamW turns the rounding noise of a gradient element near zero into a
parameter difference of up to ~4e-5 already in step 0).

Why "the first 10 steps": DP sums the gradient in another order than one process
(mean of n shard means vs one mean), a 1e-16 relative difference. Training
amplifies such differences: here even a single process that merely splits its batch
into 4 micro-batches drifts ~1e-9 away from the full-batch run after 19 steps
(docs/data_parallel.md). Both are "single-process training" to within rounding, so
the check stops at 10 steps; the table shows all of them.

The lesson model is tiny (about 0.9 MB of float64 gradients), so the buckets are
smaller than PyTorch's 25 MiB default (--bucket-mb 0.25, first bucket 0.0625):
otherwise one bucket would hold everything and nothing could overlap.
"""
import hashlib
import statistics

import numpy as np

from pdist import data
from pdist.course import lesson
from pdist.measure import memory, sync_wait, trace
from pdist.engine import precision
from pdist.engine.backend import synchronize, to_numpy
from pdist.models.gpt import GPT
from pdist.parallel import DataParallel, DataParallelNaive, Local, MixedPrecision
from pdist.parallel.layout import box_slices
from pdist.training import train

CHECK_STEPS = 10   # the tight parameter check's horizon (see the docstring)


def tolerances(dtype, precision="fp32", micro_batches=1):
    """(parameter tolerance for np.allclose, loss rtol) of the check (see the docstring)."""
    if precision != "fp32" and micro_batches == 1:
        return dict(rtol=0, atol=0), 1e-9          # the same rounding points: bit for bit
    if dtype == "float64" and precision == "fp32":
        return dict(rtol=1e-9, atol=1e-12), 1e-9
    return dict(rtol=0, atol=2e-4), 1e-5


def parse_args():
    p = lesson.parser(__doc__, steps=20, dtype="float64", batch_size=16, precision=True)
    p.add_argument("--accum", dest="micro_batches", type=int, default=1,
                   help="micro-batches per step (gradient accumulation; default %(default)s)")
    p.add_argument("--bucket-mb", type=float, default=0.25, help="bucket cap in MiB (PyTorch: 25)")
    p.add_argument("--first-bucket-mb", type=float, default=0.0625,
                   help="first bucket cap in MiB (PyTorch: 1)")
    args = lesson.validate(p, p.parse_args())
    if not (args.bucket_mb > 0 and args.first_bucket_mb > 0):
        p.error(f"--bucket-mb and --first-bucket-mb must be > 0, "
                f"got {args.bucket_mb}, {args.first_bucket_mb}")
    return p, args


def run(name, model, world, args, cfg, tokens, base_losses, base_state):
    """Train ``model`` with the one loop; returns (JSON record, passed, (step, wait, in-flight) medians)."""
    n, rank = world.size, world.rank
    opt = lesson.make_adamw(model.parameters())
    check_at = min(args.steps, CHECK_STEPS)
    tol, loss_rtol = tolerances(args.dtype, args.precision, args.micro_batches)
    comm_bytes, times, waits, in_flight, clock, ok = [], [], [], [], [0.0], [False]
    rss = memory.StepRSS()     # what the process holds: RSS after each step, and the step's peak

    def batch(step):           # the step starts here: counters and clock from zero
        b = data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step)
        world.reset_stats()
        trace.clear()
        rss.start()
        clock[0] = trace.now()
        return b

    def on_step(step, loss):   # after the optimizer step (the loss is the global-batch mean)
        synchronize()  # the step's device work is done (no-op on CPU)
        times.append(trace.now() - clock[0])
        rss.stop()
        waits.append(model.last_wait_seconds)
        in_flight.append(trace.comm_seconds())
        comm_bytes.append(world.stats.get("all_reduce", {}).get("bytes", 0))
        if step + 1 == check_at:
            ok[0] = all(np.allclose(to_numpy(pc.view(pc.tensor.data)), base_state[pc.name][box_slices(pc)],
                                    **tol) for pc in model.pieces())    # mixed precision: the fp32 masters

    with sync_wait.record():   # each step's grad_sync on this rank's clock: model.last_wait_seconds
        losses = train(model, opt, batch, args.steps, on_step=on_step)
    passed = ok[0] and np.allclose(losses[:check_at], base_losses[:check_at],
                                   rtol=loss_rtol, atol=0)
    digest = hashlib.sha1(b"".join(to_numpy(q.data).tobytes() for q in model.parameters())).hexdigest()
    oks, digests = zip(*world.all_gather_object((passed, digest)))
    mem = memory.memory_row(rank, model, opt, rss=rss.row())   # bucketed: grads are views of the buckets
    rec = {"name": name, "layout": {"dp": n, "tp": 1, "pp": 1, "zero_stage": 0}, "dtype": args.dtype,
           "precision": args.precision,
           "params": cfg.num_params(),
           "loss": losses, "baseline_loss": base_losses,
           "memory_per_rank": world.all_gather_object(mem),
           "comm_bytes_per_step": world.all_gather_object(sum(comm_bytes) / args.steps),
           "seconds_per_step": statistics.median(times)}
    timing = (statistics.median(times), statistics.median(waits), statistics.median(in_flight))
    return rec, all(oks) and len(set(digests)) == 1, timing


def report(args, cfg, n, dp, naive, bucketed, t_naive, t_bucketed):
    psi, k = naive["params"], args.micro_batches
    what = args.dtype if args.precision == "fp32" else f"{args.precision} params and grads, fp32 masters"
    print(f"GPT {cfg.n_layer} layers, n_embd {cfg.n_embd}, Psi = {psi:,} parameters ({what}); "
          f"{n} rank(s), global batch {args.batch_size} = {n} x {args.batch_size // n} rows"
          f"{f' in {k} micro-batches' if k > 1 else ''}; {len(dp.buckets)} buckets "
          f"(bytes, in issue order: {[int(b.buffer.nbytes) for b in dp.buckets]})\n")
    base = naive["baseline_loss"]
    rows = [(s, base[s], naive["loss"][s], bucketed["loss"][s],
             max(abs(naive["loss"][s] - base[s]), abs(bucketed["loss"][s] - base[s])))
            for s in range(args.steps)]
    print(lesson.table(rows, ["step", "1 process", "naive DP", "bucketed DP", "max |diff|"], "{:.6g}"))
    formula = 2 * (n - 1) / n * psi * (np.dtype(args.dtype).itemsize if args.precision == "fp32" else 2)
    rows = []
    for rec, (step_s, wait_s, fly_s) in ((naive, t_naive), (bucketed, t_bucketed)):
        rows.append((rec["name"], lesson.fmt_bytes(rec["comm_bytes_per_step"][0]), lesson.fmt_bytes(formula),
                     f"{(step_s - wait_s) * 1e3:.1f}", f"{wait_s * 1e3:.1f}", f"{fly_s * 1e3:.1f}",
                     f"{step_s * 1e3:.1f}"))
    print("\nper step, rank 0 (medians). waiting: blocked in the gradient synchronization after backward, "
          "the\ncommunication backward did not hide; compute: the rest of the step (bucketed: includes "
          "issuing the\nall-reduces inside backward); in flight: issue to completion of the all-reduces")
    print(lesson.table(rows, ["run", "all-reduced", "2(n-1)/n*Psi*bytes", "compute ms", "waiting ms",
                              "in flight ms", "step ms"]))
    b, fb = np.dtype(args.dtype).itemsize, lesson.fmt_bytes
    per = 4 * b if args.precision == "fp32" else 16      # bytes per parameter: one dtype; mixed 2 + 2 + 12
    rows = [(rec["name"], m["rank"], fb(m["params_bytes"] + m["grads_bytes"] + m["optim_bytes"]),
             fb(per * psi), fb(m["rss_bytes"] or 0), fb(m["rss_peak_bytes"] or 0))
            for rec in (naive, bucketed) for m in rec["memory_per_rank"]]
    print("\nmemory per rank: model states (pdist.measure.memory), the formula (params + grads + Adam m, v = 4bΨ; "
          "mixed\nprecision 16Ψ: 2 + 2 + fp32 master, m, v), and what the process holds (RSS after the last "
          "step,\nand its peak during that step; the interpreter and libraries included, see lesson 03)")
    print(lesson.table(rows, ["run", "rank", "states", "formula", "rss", "rss peak"]))
    tol, loss_rtol = tolerances(args.dtype, args.precision, args.micro_batches)
    print(f"\nreplicas bitwise identical; parameters after {min(args.steps, CHECK_STEPS)} steps equal "
          f"1 process "
          f"(rtol {tol['rtol']:g}, atol {tol['atol']:g}), losses of those steps too (rtol {loss_rtol:g}): "
          f"naive {naive['passed']}, bucketed {bucketed['passed']}")


def main():
    p, args = parse_args()
    world, tokens, tok = lesson.start(args)
    lesson.warn_shared_cores(world)
    n, rank, k = world.size, world.rank, args.micro_batches
    if args.batch_size % (n * k):   # the same on every rank, before any collective
        p.error(f"--batch-size {args.batch_size} must divide into {n} ranks x {k} micro-batches "
                f"(use a multiple of {n * k})")
    cfg = lesson.config_from_args(args, tok.vocab_size)
    check_at = min(args.steps, CHECK_STEPS)
    prec = args.precision       # mixed precision: one process with n x k micro-batches rounds as n ranks do
    ref = dict(tokens=tokens, precision=prec, microbatches=1 if prec == "fp32" else n * k)
    base_losses, _ = lesson.train_reference(cfg, args.seed, args.steps, args.batch_size, **ref)
    _, base_state = lesson.train_reference(cfg, args.seed, check_at, args.batch_size, **ref)

    def local():
        return Local(precision.cast_module(GPT(cfg, seed=args.seed), prec), microbatches=k)

    def mixed(s):
        return s if prec == "fp32" else MixedPrecision(s, prec)
    naive, ok_naive, t_naive = run("dp_naive", mixed(DataParallelNaive(local(), world)), world, args, cfg,
                                   tokens, base_losses, base_state)
    dp = DataParallel(local(), world, bucket_cap_mb=args.bucket_mb, first_bucket_cap_mb=args.first_bucket_mb)
    bucketed, ok_bucketed, t_bucketed = run("dp_bucketed", mixed(dp), world, args, cfg, tokens, base_losses,
                                            base_state)
    if rank == 0:
        report(args, cfg, n, dp, dict(naive, passed=ok_naive), dict(bucketed, passed=ok_bucketed),
               t_naive, t_bucketed)
    lesson.finish("02_data_parallel", ok_naive and ok_bucketed, [naive, bucketed], args, rank=rank,
                  world_size=n,
                  detail=f"-- {n} rank(s): replicas identical; parameters and losses of "
                         f"the first {check_at} steps equal single-process training")


if __name__ == "__main__":
    main()
