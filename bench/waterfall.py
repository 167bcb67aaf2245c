"""Where one training step's wall time goes, per rank: the measured waterfall and MFU.

    mpirun -n 2 python bench/waterfall.py                        # dp=2, the lessons' model
    mpirun -n 4 python bench/waterfall.py --dp 2 --tp 2 --zero 1
    mpirun -n 2 python bench/waterfall.py --pp 2 --microbatches 4 --recompute full
    mpirun -n 2 python bench/waterfall.py --convention causal --n-embd 256 --block-size 128

Each step (data, forward_backward, AdamW) is timed by pdist.measure.waterfall.Waterfall:
ideal compute (model FLOPs at this process's measured GEMM rate), kernel inefficiency,
recompute, pipeline bubble, exposed communication per group, waiting for a slower rank, and
framework overhead (the remainder), a column per rank, the sum beside the measured step, and
MFU under the 6N, 6N+12LhT and causal conventions (docs/performance.md, "The waterfall").
The first step is a warm-up and is left out. The header line says where it ran
(bench/machine.py); the JSON goes to bench/results/waterfall.json.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from machine import header, record  # noqa: E402
from pdist import comm, data  # noqa: E402
from pdist.course import lesson  # noqa: E402
from pdist.engine.backend import set_default_dtype  # noqa: E402
from pdist.measure import flops, waterfall  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.parallel import parallelize  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for axis in ("dp", "tp", "pp"):
        p.add_argument(f"--{axis}", type=int, default=None, help=f"{axis} size (default: dp = the world size)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (default 0: DDP)")
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (default %(default)s)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--convention", default=flops.DEFAULT, choices=list(flops.CONVENTIONS),
                   help="MFU's FLOP count for the ideal compute (default %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="timed steps, after one warm-up (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--batch-size", type=int, default=16, help="global batch in rows (default %(default)s)")
    for k, v in lesson.MODEL_DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"GPT {k} (default %(default)s)")
    args = p.parse_args()
    if min(args.steps, args.microbatches, args.batch_size) < 1:
        p.error(f"--steps, --microbatches and --batch-size must be >= 1, got {args.steps}, "
                f"{args.microbatches}, {args.batch_size}")
    return p, args


def main():
    p, args = parse()
    set_default_dtype(args.dtype)
    world = comm.init(timeout=120)
    tp, pp = args.tp or 1, args.pp or 1
    dp = args.dp or world.size // (tp * pp)
    if dp * tp * pp != world.size:
        p.error(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp}, but the world has {world.size} ranks")
    tokens, tok = data.char_dataset()
    over = {k: getattr(args, k) for k in lesson.MODEL_DEFAULTS}
    cfg = lesson.gpt_config(tok.vocab_size, dtype=args.dtype, recompute=args.recompute, **over)
    model = parallelize(GPT(cfg, 0), comm.DeviceMesh(dp=dp, tp=tp, pp=pp), zero_stage=args.zero,
                        sequence_parallel=tp > 1, microbatches=args.microbatches)
    opt = lesson.make_adamw(model.parameters())
    wf = waterfall.Waterfall(model, convention=args.convention)
    for step in range(args.steps + 1):
        wf.start()
        x, y = model.local_batch(*data.get_batch(tokens, args.batch_size, cfg.block_size, 0, step))
        model.forward_backward(x, y, step=step)
        opt.step()
        opt.zero_grad()
        wf.stop(resolve=False)
    text = wf.table(skip=1)
    summaries = world.all_gather_object(wf.summary(skip=1))
    if world.rank == 0:
        print(header("waterfall"))
        print(f"GPT L{cfg.n_layer} C{cfg.n_embd} T{cfg.block_size}, global batch {args.batch_size}, {args.dtype}; "
              f"dp {dp} x tp {tp} x pp {pp}, ZeRO-{args.zero}, {args.microbatches} micro-batch(es), "
              f"recompute {args.recompute}; {world.size} rank(s)\n")
        print(text)
        print("\nrecorded:", record("waterfall", {"layout": {"dp": dp, "tp": tp, "pp": pp, "zero": args.zero},
                                                 "per_rank": summaries}))
    wf.close()


if __name__ == "__main__":
    main()
