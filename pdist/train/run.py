"""``python -m pdist.train``: the run, from the flags to the last checkpoint (docs/train.md).

    main(argv) -> exit status: 0 done, 2 a usage error (every rank, before any collective),
                               130 interrupted (Ctrl-C / SIGTERM: every rank stops, nothing half-written)

Order: flags (flags.py), the data and the model's config, parallelize's own layout checks, all
before MPI starts; then the world, the model of the one shape, AdamW, ``--resume`` (the newest
complete checkpoint under ``--out/ckpt``, saved under any layout: pdist/checkpoint/sharded.py),
and the one loop (``pdist.training.train``) with the progress bar, the log, eval and saves in its
``on_step``. A checkpoint is written into a temporary sibling and renamed into place
(pdist/checkpoint/writer.py), so an interrupt during a save leaves the previous one whole.
"""
import os
import sys
from dataclasses import asdict

from pdist.train import build, corpus, flags, progress
from pdist.train.stop import Stop, Stopper


def prepare(args):
    """Everything before MPI: (tokens, config, the pretrained model or None). ValueError on a problem."""
    loaded = build.pretrained(args) if args.from_pretrained else None
    tokens = corpus.load(args)
    cfg = build.config(args, tokens.vocab_size, loaded)
    build.check(cfg, args)
    return tokens, cfg, loaded


def main(argv=None):
    args = flags.parse(argv)
    try:
        tokens, cfg, loaded = prepare(args)
    except ValueError as e:                  # CheckpointError is one: a bad --from-pretrained
        flags.parser().error(str(e))
    from pdist import comm
    from pdist.engine.backend import set_default_dtype
    set_default_dtype(args.dtype)
    world = comm.init(device=args.device)
    model, mesh = build.model(cfg, args, loaded)
    opt = build.optimizer(model, args)
    run = Run(args, world, model, opt, tokens, cfg)
    start = run.resume() if args.resume else 0
    if start is None:
        return 2
    return run.train(start)


class Run:
    """One run's state: the model and optimizer, the batches, the progress, the log."""

    def __init__(self, args, world, model, opt, tokens, cfg):
        self.args, self.world, self.model, self.opt, self.tokens, self.cfg = args, world, model, opt, tokens, cfg
        self.rank0 = world.rank == 0
        self.batch, self.eval_batch = corpus.batches(tokens, args)
        self.ckpt_dir = os.path.join(args.out, "ckpt")
        if self.rank0:
            os.makedirs(self.ckpt_dir, exist_ok=True)       # --out and its parents too
        world.barrier()
        self.log = progress.Log(os.path.join(args.out, "log.jsonl"), on=self.rank0)
        self.newest = None                     # the newest checkpoint this run wrote or read

    def say(self, text):
        if self.rank0:
            print(text, flush=True)

    def resume(self):
        """Load the newest complete checkpoint; its step (None: the checkpoint holds another model)."""
        from pdist import checkpoint
        path = checkpoint.latest(self.ckpt_dir) if self.rank0 else None
        path = self.world.broadcast_object(path)
        try:
            step, extra = checkpoint.load(self.model, self.opt, path, cast=self.args.precision != "fp32")
        except checkpoint.CheckpointError as e:
            self.say(f"error: --resume: {path} cannot continue this run: {e}. Pass the model flags it was saved "
                     f"with (the 'start' line of {self.log.path} lists them), or another --out.")
            return None
        self.newest = path
        extra = extra or {}
        for k in ("seed", "batch_size", "data"):
            mine = self.tokens.name if k == "data" else getattr(self.args, k)
            if k in extra and extra[k] != mine:
                self.say(f"note: the checkpoint was trained with {k} = {extra[k]!r}; this run uses {mine!r}")
        self.say(f"resumed from {path} at step {step} (saved under {extra.get('layout', 'another layout')})")
        return step

    def layout(self):
        a = self.args
        return {k: getattr(a, k) for k in ("dp", "cp", "tp", "pp", "ep", "zero", "sp", "schedule", "microbatches",
                                            "precision", "recompute")}

    def train(self, start):
        from pdist.training import train
        a = self.args
        if start >= a.steps:
            self.say(f"already at step {start} of --steps {a.steps}: nothing to train (raise --steps to go on)")
            return 0
        self.start_lines(start)
        tokens = a.batch_size * self.cfg.block_size
        peak = a.peak_tflops * 1e12 if a.peak_tflops else (progress.measured_peak(self.cfg.dtype) if self.rank0 else 1)
        self.bar = progress.Progress(start, a.steps, tokens, progress.flops_per_token(self.cfg) * tokens, peak,
                                     self.world.size, a.log_every, on=self.rank0)
        build.set_lr(self.opt, build.lr_at(start, a))
        self.done, self.wf = start, None
        if a.plot:
            from pdist.train import plot
            self.wf = plot.start_waterfall(self.model, self.say)
        try:
            with Stopper(self.world) as self.stopper:
                train(self.model, self.opt, self.batch, a.steps - start, on_step=self.on_step, start=start)
        except Stop as e:
            if self.wf is not None:
                self.wf.close()
            return self.interrupted(self.done, e.name)
        self.log.write(event="end", step=a.steps, reason="done")
        self.log.close()
        if a.plot:
            self.plots()
        self.say(f"done: {a.steps} steps; checkpoint {self.newest}; log {self.log.path}")
        return 0

    def plots(self):
        """--plot at the end: the waterfall's table (collective) and summary, then the PNGs (rank 0)."""
        from pdist.train import plot
        summary = None
        if self.wf is not None:
            table = self.wf.table()
            summary = self.wf.summary() if self.rank0 else None
            self.wf.close()
            self.say(table)
        if self.rank0:
            plot.write(self.args.out, self.log.path, self.say, summary)

    def start_lines(self, start):
        a = self.args
        self.say(build.describe(self.cfg, a) + f"; {self.world.size} rank(s)")
        self.say(self.tokens.describe() + f"; batch {a.batch_size} x {self.cfg.block_size} tokens")
        if self.rank0:
            from pdist.checkpoint import latest
            from pdist.course.lesson import warn_shared_cores
            warn_shared_cores(self.world)
            if start == 0 and latest(self.ckpt_dir):
                print(f"note: {self.ckpt_dir} holds checkpoints of an earlier run ({latest(self.ckpt_dir)}); this run "
                      "saves beside them (replacing those of the same step) and --resume takes the newest", flush=True)
        self.log.write(event="start", step=start, world_size=self.world.size, layout=self.layout(),
                       model=dict(model_type=type(self.cfg).model_type, **asdict(self.cfg)),
                       params=self.cfg.num_params(), data=self.tokens.name, flags=vars(a))

    def on_step(self, step, loss):
        a, done = self.args, step + 1
        self.done = done
        rec = self.bar.step(step, loss, self.opt.param_groups[0]["lr"])
        self.log.write(**rec)
        build.set_lr(self.opt, build.lr_at(done, a))
        if a.eval_every and (done % a.eval_every == 0 or done == a.steps):
            ev = self.evaluate()
            self.log.write(step=done, eval_loss=ev)
            self.bar.say(f"step {done}: eval loss {ev:.4f} ({a.eval_batches} held-out batches)")
        if a.save_every and done % a.save_every == 0 or done == a.steps:
            self.save(done)
        self.bar.resume_clock()
        self.stopper.check()

    def evaluate(self):
        """The mean loss of the held-out batches, under the run's layout: the step's forward and
        backward (its gradients dropped; the fp16 scaler untouched), the same on every rank."""
        from pdist.parallel.base import Strategy
        total = 0.0
        for i in range(self.args.eval_batches):
            total += Strategy.forward_backward(self.model, *self.model.local_batch(*self.eval_batch(i)))
        self.opt.zero_grad(set_to_none=False)
        return total / self.args.eval_batches

    def save(self, done):
        from pdist import checkpoint
        path = os.path.join(self.ckpt_dir, f"step-{done:06d}")
        a = self.args
        extra = {"seed": a.seed, "batch_size": a.batch_size, "data": self.tokens.name, "next_step": done,
                 "layout": build.describe(self.cfg, a).split("; ", 1)[1]}
        checkpoint.save(self.model, self.opt, path, step=done, extra=extra, keep=a.keep, overwrite=True)
        self.newest = path
        self.log.write(event="save", step=done, path=path)
        self.bar.say(f"step {done}: saved {path}")

    def interrupted(self, done, name):
        """Ctrl-C (SIGINT) or SIGTERM (stop.py): every rank stopped after step ``done``."""
        from pdist.checkpoint import latest
        self.log.write(event="end", step=done, reason="interrupted", signal=name)
        self.log.close()
        if self.rank0:
            newest = latest(self.ckpt_dir)
            where = f"the newest complete checkpoint is {newest}" if newest else "no checkpoint was written"
            sys.stdout.write(f"\n{name}: every rank stopped after step {done}: {where}; nothing is half-written. "
                             f"Continue with the same command and --resume.\n")
            sys.stdout.flush()
        return 130

