"""Pipeline parallelism: a model as a sequence of layers, cut into stages, run by a schedule.

    f = f_{V-1} o ... o f_1 o f_0,   virtual stage k = chunk c of rank s, k = c p + s
    L = (1/m) sum_{i<m} loss(f(x_i), y_i)          (x_i: micro-batch i of this rank's batch)

Rank s computes only its chunks; activations f_k(...)(x_i) travel forward to
rank (k+1) mod p and their gradients dL/dh travel back, so
dL/dW_k = sum_i dL_i/dW_k accumulates in W_k.grad over the micro-batches exactly
as single-process backprop over the whole batch would: K optimizer steps equal
single-process training (GPipe: Huang et al., 2019; 1F1B and interleaving:
Narayanan et al., 2021). The order of the work is a schedule (schedules.py);
``PipelineParallel`` only executes it, one instruction at a time, through a table
``{op: method}``. Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV; Qi et al., 2024) split
each BACKWARD into BACKWARD_INPUT (B: dL/dx, sent at once) and BACKWARD_WEIGHT (W: dL/dW,
later): split_backward.py. The V-shaped ones place chunk 0 of rank s at virtual stage s
and chunk 1 at 2p - 1 - s (``placement = "v"``), so rank 0 holds the embedding and the
head: a tied embedding is one weight there, with no embedding group.

The model as a sequence, as its plan cuts it (``ModelPlan.pipeline``,
pdist/models/plan.py): [first part (the embedding)] + blocks 0 .. L-1 + [last part (the
final norm and the head)]. The blocks are split over the V virtual stages (evenly, the
first L mod V stages one more, or by a given ``partition``); the first part joins the
first stage, the last part and the loss the last. ``PipelineParallel(model, pp_group)``
keeps only this rank's part of the model: its blocks (names unchanged), the first part's
modules on the first stage, the last part's on the last. A head tied to the embedding
(the plan's ``tied`` pairs) gets its own copy on the last stage (Megatron's "embedding
group"): in ``finish_grad_sync`` the first and last stage all-reduce (sum) the two
copies' gradients, so both get the full gradient dL/dW = (embedding part) + (head
part) and the same update -- the copies stay equal. An ``nn.Sequential`` pipelines too
(the trivial plan): its children are the blocks, with ``loss_fn`` and ``act_shape``.

The gradients of a step are kept by the precision policy's ``pipeline_grads``
(pdist/engine/grad_rounding.py): fp32, backward on S·loss(micro-batch)/m, sums in
``.grad``, the tied copies' gradients all-reduced here; bf16/fp16 (``parallelize(...,
precision=...)``), backward on S·loss (S: fp16's loss scale, ``compute``'s argument;
no 1/m), each stage's rounded micro-batch gradients summed in fp32 and the mean rounded
once, a tied embedding's parts combined per micro-batch: one process's rounding points, bit
for bit. Activations travel in the compute dtype. An fp16 overflow on any stage reaches
every rank through the [loss, #non-finite] all-reduce, and every rank skips the step
(mixed_precision.py). What a step measures (the peak stash, the timeline) is kept by a
step hook (stats.py): this file reads no clock.
"""


from pdist.engine import hooks
from pdist.engine.autograd import Tensor
from pdist.engine.backend import default_dtype, to_device, to_numpy, xp
from pdist.models.plan import get, plan_of
from pdist.comm import default_group
from pdist.parallel.base import ParallelModule, Strategy
from pdist.parallel.pipeline.stages import check_pipeline, stage_chunks
from pdist.parallel.pipeline.schedules import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, OPTIMIZER_STEP,
                                               RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, make_schedule,
                                               placement_of, rendezvous_batches, stage_owner, virtual_stage)
from pdist.parallel.pipeline.instructions import PASSES
from pdist.parallel.pipeline.split_backward import backward_input, backward_weight, check_all_weights_done
from pdist.parallel.pipeline import stats  # noqa: F401  (the step's peak stash and timeline: a default step hook)


class PipelineParallel(ParallelModule):
    """``PipelineParallel(model, pp_group, schedule="1f1b", microbatches=4, chunks=1)``.

    ``model``: the GPT (or a strategy that transformed it, e.g. TensorParallel), or an
    ``nn.Sequential`` with ``loss_fn(out, target)`` and ``act_shape(k, rows, x)`` (shape
    of the activation entering virtual stage k). ``record_timeline = True`` makes the
    next step align the pp ranks' clocks at a barrier and keep ``timeline``:
    [(Instr, start, end)] of every compute (stats.py)."""

    pipeline = True
    has_late_grads = True    # gradients complete over the whole schedule (and the tied embedding)

    def __init__(self, model, group=None, schedule="1f1b", microbatches=4, chunks=1, partition=None,
                 loss_fn=None, act_shape=None):
        chunks, p = default_chunks(schedule, chunks), default_group(group).size
        programs = make_schedule(schedule, p, microbatches, chunks)   # bad args raise here, before any collective
        module = model.module if isinstance(model, Strategy) else model
        pplan = plan_of(module).pipeline
        check_pipeline(module, pplan, p * chunks, microbatches, getattr(model, "microbatches", 1), partition,
                       loss_fn, act_shape)
        super().__init__(model, group)
        g = self.group
        self.placement = placement_of(schedule)              # "loop" (k = c p + s) or "v" (ZB-V, DualPipeV)
        self.num_virtual_stages = V = g.size * chunks
        self.pp_world_size, self.pp_rank = g.size, g.rank
        self.pp_is_first_stage = stage_owner(0, g.size, self.placement)[0] == g.rank
        self.pp_is_last_stage = stage_owner(V - 1, g.size, self.placement)[0] == g.rank   # "v": rank 0 too
        self.schedule, self.num_microbatches, self.num_chunks = schedule, microbatches, chunks
        self.program = programs[g.rank]
        # messages go out in batches (one NCCL group call each) in an order that can't deadlock
        # even when every send blocks until its receive is posted (schedules.rendezvous_batches)
        self._plan = {anchor: batch for anchor, batch in rendezvous_batches(programs)[g.rank]}
        self.chunks, self.tied = stage_chunks(self.module, pplan, g.size, g.rank, chunks, partition, self.placement)
        both = self.pp_is_first_stage and self.pp_is_last_stage and V > 1     # "v": rank 0, embedding + head
        self.local_tied = [get(self.module, src) for src in pplan.tied.values()] if both else []
        self.loss_fn = loss_fn or (get(self.module, pplan.loss) if self.pp_is_last_stage else None)
        shards = self.inner.seq_shards
        self.act_shape = act_shape or (lambda k, rows, x: (rows, x.shape[1] // shards, pplan.hidden))
        params = self.inner.parameters()             # activations travel in the compute dtype
        self.dtype = getattr(params[0], "compute_dtype", params[0].dtype) if params else default_dtype()
        self.embedding_group = None
        if g.size > 1:                                # split is collective: every stage calls it
            ends = self.pp_is_first_stage or self.pp_is_last_stage
            e = g.split(0 if ends else 1, name="embedding")
            self.embedding_group = e if ends and self.tied else None
        self.loss_weight = 1.0       # every stage's share: the last stage's loss, MoE aux losses (0 elsewhere)
        self.record_timeline, self.timeline, self.peak_stash = False, [], 0
        self.peak_held_w = self.peak_held_w_bytes = 0
        self._dispatch = {FORWARD: self._forward, BACKWARD: self._backward, SEND_ACT: self._send_act,
                          RECV_ACT: self._recv_act, SEND_GRAD: self._send_grad, RECV_GRAD: self._recv_grad,
                          BACKWARD_INPUT: lambda ins, g: backward_input(self, ins, g),
                          BACKWARD_WEIGHT: lambda ins, g: backward_weight(self, ins), OPTIMIZER_STEP: self._end_of_step}

    microbatches = property(lambda self: self.num_microbatches)

    def __call__(self, *args, **kw):
        raise TypeError("a pipeline stage holds only part of the model: train with forward_backward(x, y), "
                        "or load full_state_dict() into a GPT for inference")

    # ------------------------------------------------------------------ step
    def local_batch(self, x, y):
        """Every stage takes the whole batch of its pipeline (the first uses x, the last y)."""
        self._rows_of(x)
        return self.inner.local_batch(x, y)

    def _rows_of(self, x):
        """The rows of one micro-batch of x; the same error on every rank when m does not divide them."""
        if len(x) % self.num_microbatches:
            raise ValueError(f"pipeline: this rank's batch of {len(x)} rows does not split into "
                             f"{self.num_microbatches} micro-batches; use a batch size divisible by m (x dp)")
        return len(x) // self.num_microbatches

    def compute(self, x, y, loss_scale=1.0):
        """Run this rank's program over the m micro-batches of (x, y); returns the sum of
        the micro-batch losses / m on the last stage, plus what this stage's chunks add (a
        mixture of experts' balancing losses) / m, 0 elsewhere. ``loss_scale``: fp16's S."""
        m = self.num_microbatches
        self._x, self._y, self._rows = to_device(x), to_device(y), self._rows_of(x)   # NumPy -> the device
        self._recvs, self._sends, self._stash, self._grads, self._staged = {}, [], {}, {}, {}
        self.losses, self._held_w = [], {}
        self._keeper = self.grad_keeper()
        self._scale = self._keeper.backward_scale(loss_scale)   # fp32: S/m; bf16/fp16: S (fp32 sums)
        for chunk in self.chunks:
            chunk.start(self._scale)
        self._run_program()
        self._keeper.finish()                        # bf16/fp16: round(Σ_mb fp32(g_mb) / m), one rounding
        losses = self.losses + [v * (1.0 / m) for chunk in self.chunks for v in chunk.losses]
        # the micro-batch losses in one device -> host copy per step
        return sum(float(v) for v in to_numpy(xp.stack(losses))) if losses else 0.0

    def grad_keeper(self):
        """The step's keeper of this stage's gradients: the precision policy's (grad_rounding.py)."""
        return self.policy.pipeline_grads(self.inner.parameters(), self.tied, (0, self.num_virtual_stages - 1),
                                          self.num_microbatches, self.local_tied)

    def _run_program(self):
        for j, ins in enumerate(self.program):
            if j in self._plan:
                self._post(self._plan[j])
            if ins.op in PASSES:                     # a pass: its message first, then the pass's span
                got = self._input(ins)
                with hooks.span(PASSES[ins.op], mb=ins.mb, chunk=ins.chunk):
                    self._dispatch[ins.op](ins, got)
            else:
                self._dispatch[ins.op](ins)

    def _input(self, ins):
        """What a pass needs from another stage (waited for): F the activation entering it, B
        the gradient of its output; None at the model's ends (and for W)."""
        mb, c, k = ins.mb, ins.chunk, self._stage(ins)
        if ins.op == FORWARD:
            return self._micro(self._x, mb) if k == 0 else Tensor(self._wait(("act", mb, c)), requires_grad=True)
        if ins.op == BACKWARD_WEIGHT or k == self.num_virtual_stages - 1:
            return None
        return self._wait(("grad", mb, c))

    def finish_grad_sync(self):
        """The inner strategy's sync (e.g. sequence-parallel grads), then the tied weights:
        dL/dW = embedding part + head part, all-reduced (sum) over the first and last stage
        (Megatron's embedding group; bf16/fp16: each micro-batch's parts, as one process)."""
        self.inner.finish_grad_sync()
        if self.embedding_group is not None:
            parts = self._keeper.tied_parts()        # what this end holds of the tied gradients
            for buf in parts:
                self.embedding_group.all_reduce(buf, op="sum")
            self._keeper.set_tied(parts)

    def _stage(self, ins):
        return virtual_stage(ins.chunk, self.pp_world_size, self.pp_rank, self.placement)

    def _tag(self, kind, mb, k):
        return 2 * (mb * self.num_virtual_stages + k) + (kind == "grad")

    def _micro(self, a, mb):
        return a[mb * self._rows:(mb + 1) * self._rows]

    def _wait(self, key):
        work, buf = self._recvs.pop(key)
        work.wait()                                  # cooperative when ranks outnumber cores
        return buf

    def _recv(self, kind, ins):
        k = self._stage(ins)
        shape = self.act_shape(k if kind == "act" else k + 1, self._rows, self._x)
        buf = xp.empty(shape, dtype=self.dtype)
        self._staged[ins] = ("recv", buf, ins.peer, self._tag(kind, ins.mb, k), (kind, ins.mb, ins.chunk))

    def _send(self, kind, ins, buf, k_to):
        buf = xp.ascontiguousarray(buf)
        self._staged[ins] = ("send", buf, ins.peer, self._tag(kind, ins.mb, k_to), None)

    def _post(self, batch):
        """Post the staged messages of one batch together (group.batch_isend_irecv)."""
        ops = [self._staged.pop(ins) for ins in batch]
        self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]   # free finished sends
        works = self.group.batch_isend_irecv([op[:4] for op in ops])
        for (kind, buf, _, _, key), work in zip(ops, works):
            if kind == "recv":
                self._recvs[key] = (work, buf)
            else:
                self._sends.append((work, buf))

    def _recv_act(self, ins):
        self._recv("act", ins)

    def _recv_grad(self, ins):
        self._recv("grad", ins)

    def _send_act(self, ins):
        self._send("act", ins, self._stash[(ins.mb, ins.chunk)][1].data, self._stage(ins) + 1)

    def _send_grad(self, ins):
        self._send("grad", ins, self._grads.pop((ins.mb, ins.chunk)), self._stage(ins) - 1)

    def _forward(self, ins, x):
        mb, c, k = ins.mb, ins.chunk, self._stage(ins)
        out = self.chunks[c](x)                              # (b, T, C), or logits on the last stage
        if k == self.num_virtual_stages - 1:
            out = self.loss_fn(out, self._micro(self._y, mb))
            self.losses.append(out.data * (1.0 / self.num_microbatches))
            if self._scale != 1.0:
                out = out * self._scale              # backward on l S/m (bf16/fp16: l S, S a power of two)
        self._stash[(mb, c)] = (x, out)

    def _backward(self, ins, g):
        mb, c, k = ins.mb, ins.chunk, self._stage(ins)
        x, out = self._stash.pop((mb, c))                    # free the stash after its backward
        out.backward(g)
        if k > 0:
            self._grads[(mb, c)] = x.grad if x.grad is not None else xp.zeros_like(x.data)
        self._keeper.after_backward(k, mb)           # bf16/fp16: this micro-batch's grads into fp32 sums

    def _end_of_step(self, ins):
        """The schedule's last instruction: every send has landed (the optimizer step that
        follows is the caller's ``opt.step()``)."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        check_all_weights_done(self)


def default_chunks(schedule, chunks):
    """The chunks per rank a schedule runs: 2 for the V-shaped ones (ZB-V, DualPipeV) when
    left at 1; otherwise as given (make_schedule refuses what a schedule cannot run)."""
    return 2 if chunks == 1 and placement_of(schedule) == "v" else chunks


__all__ = ["PipelineParallel", "default_chunks"]
