"""Lesson 02 -- data parallelism: n replicas, n slices of one global batch, one all-reduce.

    python lessons/02_data_parallel.py                 # 1 rank
    mpirun -n 4 python lessons/02_data_parallel.py     # 4 ranks (or -n 2)
    mpirun -n 2 python lessons/02_data_parallel.py --accum 2 --steps 10 --json dp.json

Each rank holds the whole GPT and takes rows [r B/n, (r+1) B/n) of the global batch
of every step. Its loss is the mean over its rows, so averaging the n gradients
(all-reduce, op="avg") gives the gradient of the mean over the global batch: the
update single-process training makes. Two ways to average
(pdist/parallel/data_parallel.py):

* DataParallelNaive: after backward, one all-reduce per parameter.
* DataParallel: gradients in flat buckets; a bucket's all-reduce starts during
  backward, as soon as its last gradient is ready, and overlaps the rest of backward.

The lesson trains both for --steps AdamW steps beside single-process training on the
same global batches and prints: the loss per step (1 process vs naive vs bucketed),
the bytes each rank all-reduces per step next to 2(n-1)/n * Psi * bytes, and the step
time split into compute and time spent waiting on communication. PASS means: all replicas are bitwise
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

from pdist import comm, data, gpt, lesson, memory, trace
from pdist.backend import set_default_dtype, to_numpy
from pdist.parallel.data_parallel import DataParallel, DataParallelNaive

p = lesson.parser(__doc__, steps=20, dtype="float64")
p.add_argument("--batch-size", type=int, default=16, help="global batch (rows), divisible by ranks*accum")
p.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
p.add_argument("--bucket-mb", type=float, default=0.25, help="bucket cap in MiB (PyTorch: 25)")
p.add_argument("--first-bucket-mb", type=float, default=0.0625, help="first bucket cap in MiB (PyTorch: 1)")
args = p.parse_args()

world = comm.init()
n, rank = world.size, world.rank
# checked on every rank before any collective: a clear error, never a hang
if args.steps < 1:
    raise SystemExit(f"--steps must be >= 1, got {args.steps}")
if args.accum < 1 or args.batch_size % (n * args.accum):
    raise SystemExit(f"--batch-size {args.batch_size} must divide into {n} ranks x {args.accum} "
                     f"micro-batches (use a multiple of {n * max(args.accum, 1)})")
set_default_dtype(args.dtype)
tokens, tok = data.char_dataset()
cfg = lesson.gpt_config(tok.vocab_size, dtype=args.dtype)
CHECK_STEPS = min(args.steps, 10)          # the tight parameter check's horizon (see the docstring)
base_losses, _ = lesson.train_reference(cfg, args.seed, args.steps, args.batch_size, tokens=tokens)
_, base_state = lesson.train_reference(cfg, args.seed, CHECK_STEPS, args.batch_size, tokens=tokens)
tol = dict(rtol=1e-9, atol=1e-12) if args.dtype == "float64" else dict(rtol=0, atol=2e-4)
loss_rtol = 1e-9 if args.dtype == "float64" else 1e-5
psi = sum(int(np.prod(s)) for s in cfg.param_shapes().values())
itemsize = np.dtype(args.dtype).itemsize


def run(name, dp):
    """Train dp for args.steps; returns the run's JSON record and per-step timings."""
    opt = lesson.make_adamw(dp.parameters())
    losses, comm_bytes, times, waits, in_flight = [], 0, [], [], []
    k, ok = args.accum, False
    for step in range(args.steps):
        x, y = dp.shard(data.get_batch(tokens, args.batch_size, cfg.block_size, args.seed, step))  # (B/n, T)
        mb = len(x) // k
        world.reset_stats()
        trace.clear()
        t0 = trace.now()
        dp.zero_grad()
        local = 0.0
        for i in range(k):
            sl = slice(i * mb, (i + 1) * mb)
            if i < k - 1:
                with dp.no_sync():                 # accumulate locally, no communication
                    _, loss = dp(x[sl], y[sl])
                    (loss * (1.0 / k)).backward()
            else:
                _, loss = dp(x[sl], y[sl])
                (loss * (1.0 / k)).backward()      # DataParallel: bucket all-reduces start in here
            local += loss.item() / k
        dp.finish_gradient_synchronization()        # wait: p.grad = mean over the global batch
        opt.step()
        if step + 1 == CHECK_STEPS:
            ok = all(np.allclose(to_numpy(q.data), base_state[nm], **tol)
                     for nm, q in dp.module.named_parameters())
        times.append(trace.now() - t0)
        waits.append(dp.last_wait_seconds)
        in_flight.append(trace.comm_seconds())
        comm_bytes += world.stats.get("all_reduce", {}).get("bytes", 0)
        g = np.array([local])
        world.all_reduce(g, op="avg")               # the global-batch loss, for printing
        losses.append(float(g[0]))
    ok = ok and np.allclose(losses[:CHECK_STEPS], base_losses[:CHECK_STEPS], rtol=loss_rtol, atol=0)
    digest = hashlib.sha1(b"".join(to_numpy(q.data).tobytes() for q in dp.parameters())).hexdigest()
    oks, digests = zip(*world.all_gather_object((ok, digest)))
    mem = memory.memory_row(rank, dp.module, opt)   # bucketed: grads are views of the buckets, counted once
    rec = {"name": name, "layout": {"dp": n, "tp": 1, "pp": 1, "zero_stage": 0}, "dtype": args.dtype,
           "params": psi, "loss": losses, "baseline_loss": base_losses,
           "memory_per_rank": world.all_gather_object(mem),
           "comm_bytes_per_step": world.all_gather_object(comm_bytes / args.steps),
           "seconds_per_step": statistics.median(times)}
    timing = (statistics.median(times), statistics.median(waits), statistics.median(in_flight))
    return rec, all(oks) and len(set(digests)) == 1, timing


def model():
    return gpt.GPT(cfg, seed=args.seed)


naive, ok_naive, t_naive = run("dp_naive", DataParallelNaive(model()))
dp = DataParallel(model(), bucket_cap_mb=args.bucket_mb, first_bucket_cap_mb=args.first_bucket_mb)
bucketed, ok_bucketed, t_bucketed = run("dp_bucketed", dp)

if rank == 0:
    print(f"GPT {cfg.n_layer} layers, n_embd {cfg.n_embd}, Psi = {psi:,} parameters ({args.dtype}); "
          f"{n} rank(s), global batch {args.batch_size} = {n} x {args.batch_size // n} rows"
          f"{f' in {args.accum} micro-batches' if args.accum > 1 else ''}; {len(dp.buckets)} buckets "
          f"(bytes, in issue order: {[int(b.buffer.nbytes) for b in dp.buckets]})\n")
    rows = [(s, base_losses[s], naive["loss"][s], bucketed["loss"][s],
             max(abs(naive["loss"][s] - base_losses[s]), abs(bucketed["loss"][s] - base_losses[s])))
            for s in range(args.steps)]
    print(lesson.table(rows, ["step", "1 process", "naive DP", "bucketed DP", "max |diff|"], "{:.6g}"))
    formula = 2 * (n - 1) / n * psi * itemsize
    rows = []
    for rec, (step_s, wait_s, fly_s) in ((naive, t_naive), (bucketed, t_bucketed)):
        rows.append((rec["name"], lesson.fmt_bytes(rec["comm_bytes_per_step"][0]), lesson.fmt_bytes(formula),
                     f"{(step_s - wait_s) * 1e3:.1f}", f"{wait_s * 1e3:.1f}", f"{fly_s * 1e3:.1f}",
                     f"{step_s * 1e3:.1f}"))
    print("\nper step, rank 0 (medians). waiting: blocked in finish_gradient_synchronization(), the "
          "communication\nbackward did not hide; compute: the rest of the step (bucketed: includes issuing "
          "the all-reduces\ninside backward); in flight: issue to completion of the all-reduces")
    print(lesson.table(rows, ["run", "all-reduced", "2(n-1)/n*Psi*bytes", "compute ms", "waiting ms",
                              "in flight ms", "step ms"]))
    print(f"\nreplicas bitwise identical; parameters after {CHECK_STEPS} steps equal 1 process "
          f"(rtol {tol['rtol']:g}, atol {tol['atol']:g}), losses of those steps too (rtol {loss_rtol:g}): "
          f"naive {ok_naive}, bucketed {ok_bucketed}")
lesson.finish("02_data_parallel", ok_naive and ok_bucketed, [naive, bucketed], args, rank=rank, world_size=n,
              detail=f"-- {n} rank(s): replicas identical; parameters and losses of "
                     f"the first {CHECK_STEPS} steps equal single-process training")
