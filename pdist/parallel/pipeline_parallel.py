"""Pipeline parallelism: a model as a sequence of layers, cut into stages, run by a schedule.

    f = f_{V-1} o ... o f_1 o f_0,   virtual stage k = chunk c of rank s, k = c p + s
    L = (1/m) sum_{i<m} loss(f(x_i), y_i)          (x_i: micro-batch i of this rank's batch)

Rank s computes only its chunks; activations f_k(...)(x_i) travel forward to
rank (k+1) mod p and their gradients dL/dh travel back, so
dL/dW_k = sum_i dL_i/dW_k accumulates in W_k.grad over the micro-batches exactly
as single-process backprop over the whole batch would: K optimizer steps equal
single-process training (GPipe: Huang et al., 2019; 1F1B and interleaving:
Narayanan et al., 2021). The order of the work is a schedule (schedules.py);
``PipelineParallel`` only executes it.

The GPT as a sequence: [embedding (wte, wpe)] + blocks h.0 .. h.{L-1} + [ln_f,
lm_head]. The blocks are split over the V virtual stages (evenly, the first
L mod V stages one more, or by a given ``partition``); the embedding joins the
first stage, ln_f and the head (and the loss) the last. Names stay GPT-2's
(``transformer.h.3.attn.c_attn.weight``). The head is tied to ``wte``: the last
stage holds a copy, ``lm_head.weight`` (Megatron's "embedding group"): before each
optimizer step the first and last stage all-reduce (sum) the two copies'
gradients, so both get the full gradient dL/dwte = (embedding part) + (head part)
and the same AdamW update -- the copies stay equal, step after step.

Pipeline x data parallel: with ``dp_group`` each pipeline trains on its dp shard
and every gradient is averaged (all_reduce avg) over the dp group before the step.
"""
import numpy as np

from pdist import functional as F
from pdist import nn, trace
from pdist.autograd import Tensor
from pdist.backend import asarray, xp
from pdist.gpt import Block, gpt_init
from pdist.parallel import schedules as S


def partition_layers(n_layers, n_stages, partition=None):
    """[(start, end)] for each stage: contiguous runs covering range(n_layers).
    Default: n_layers // n_stages each, the first n_layers % n_stages one more;
    ``partition``: explicit layer counts per stage (uneven splits)."""
    if n_stages > n_layers:
        raise ValueError(f"pipeline: {n_stages} (virtual) stages but only {n_layers} layers to split; "
                         f"use at most {n_layers} stages (pp * chunks) or a deeper model")
    if partition is None:
        counts = [n_layers // n_stages + (i < n_layers % n_stages) for i in range(n_stages)]
    else:
        counts = list(partition)
        if len(counts) != n_stages or any(not isinstance(c, (int, np.integer)) or c < 1 for c in counts) \
                or sum(counts) != n_layers:
            raise ValueError(f"pipeline partition {counts} must give {n_stages} positive layer counts "
                             f"summing to {n_layers} (one per virtual stage)")
    starts = np.cumsum([0] + counts)
    return [(int(starts[i]), int(starts[i + 1])) for i in range(n_stages)]


class PipelineStage(nn.Module):
    """One model chunk: consecutive layers applied in order, y = f_b(...f_a(x)),
    registered under their names in the whole model (so parameter names match it)."""

    def __init__(self, named_layers):
        super().__init__()
        for name, layer in named_layers:
            setattr(self, name, layer)

    def forward(self, x):
        for layer in self._modules.values():
            x = layer(x)
        return x


def split_sequential(model, n_stages, k, partition=None):
    """Chunk k of an ``nn.Sequential`` split into n_stages (names stay '0', '1', ...)."""
    a, b = partition_layers(len(model), n_stages, partition)[k]
    return PipelineStage([(str(i), model[i]) for i in range(a, b)])


class _Zeros:
    """Placeholder generator: GPT stage weights are filled by gpt_init right after."""
    def uniform(self, lo, hi, shape):
        return np.zeros(shape)

    def standard_normal(self, shape):
        return np.zeros(shape)


class GPTEmbedding(nn.Module):
    """x_0 = wte[idx] + wpe[0..T):  idx (B, T) -> (B, T, C)."""

    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, rng=_Zeros())
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, rng=_Zeros())

    def forward(self, idx):
        idx = getattr(idx, "data", idx)
        return self.wte(idx) + self.wpe(xp.arange(idx.shape[-1]))  # (B, T, C)


class GPTHead(nn.Module):
    """logits = x wte^T:  (B, T, C) -> (B, T, V); ``weight`` is wte itself or its copy."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return F.linear(x, self.weight.T)  # (B, T, V)


def master_name(name):
    """The single-process GPT parameter a pipeline parameter equals (lm_head is wte's copy)."""
    return "transformer.wte.weight" if name == "lm_head.weight" else name


def gpt_stage(cfg, seed, k, n_virtual, partition=None, wte=None):
    """Virtual stage k of the GPT, weights from gpt_init (independent of the layout).
    ``wte``: the embedding Parameter when this rank also holds stage 0 (shared, no copy)."""
    a, b = partition_layers(cfg.n_layer, n_virtual, partition)[k]
    layers = [("transformer", GPTEmbedding(cfg))] if k == 0 else []
    layers += [(f"transformer.h.{i}", Block(cfg)) for i in range(a, b)]
    if k == n_virtual - 1:
        if wte is None:
            wte = layers[0][1].wte.weight if k == 0 else nn.Parameter(np.zeros((cfg.vocab_size, cfg.n_embd)))
        layers += [("transformer.ln_f", nn.LayerNorm(cfg.n_embd)), ("lm_head", GPTHead(wte))]
    stage = PipelineStage(layers)
    for name, p in stage.named_parameters():
        p.data, p.name = asarray(gpt_init(cfg, master_name(name), seed), dtype=cfg.dtype), name
    return stage


def gpt_pipeline(cfg, seed, pp_group, n_microbatches, schedule="1f1b", n_chunks=1, partition=None,
                 dp_group=None):
    """This rank's chunks of the GPT and the executor that trains them."""
    if cfg.dropout:
        raise ValueError("gpt_pipeline: dropout must be 0 (random masks would differ from the "
                         "single-process run); set GPTConfig(dropout=0.0)")
    p, s = pp_group.size, pp_group.rank
    V = p * n_chunks
    S.make_schedule(schedule, p, n_microbatches, n_chunks)       # bad (schedule, m, v): raise now
    partition_layers(cfg.n_layer, V, partition)                   # too many stages: raise now
    chunks = []
    for c in range(n_chunks):
        k = c * p + s
        wte = chunks[0].transformer.wte.weight if (k == V - 1 and s == 0 and c > 0) else None
        chunks.append(gpt_stage(cfg, seed, k, V, partition, wte))
    tied = None
    if p > 1:                                     # the first stage's wte and the last stage's copy
        tied = [chunks[0].transformer.wte.weight] if s == 0 else \
               [chunks[-1].lm_head.weight] if s == p - 1 else []
    return PipelineParallel(chunks, pp_group, n_microbatches, schedule,
                            act_shape=lambda k, b: (b, cfg.block_size, cfg.n_embd),
                            loss_fn=F.cross_entropy, dp_group=dp_group, tied=tied)


class PipelineParallel:
    """Runs a schedule over ``pp_group`` with non-blocking send/recv.

    chunks: this rank's model chunks (chunk c = virtual stage c p + rank);
    act_shape(k, b): shape of the activation entering virtual stage k for b rows
    (known in advance, so no shape handshake); loss_fn(out, target) -> mean loss
    of a micro-batch (on the last stage); tied: this rank's copies of a weight
    shared by the first and last stage, their gradients summed between the two
    (None: no tied weights; with p > 1 every stage passes a list, maybe empty).
    ``train_step(x, y, optimizer)`` does one step on this rank's rows."""

    def __init__(self, chunks, pp_group, n_microbatches, schedule="1f1b", act_shape=None, loss_fn=None,
                 dp_group=None, tied=None):
        self.chunks, self.pg, self.dp_group = list(chunks), pp_group, dp_group
        self.p, self.s, self.v, self.m = pp_group.size, pp_group.rank, len(self.chunks), n_microbatches
        self.V = self.p * self.v
        self.schedule_name = schedule
        self.program = S.make_schedule(schedule, self.p, self.m, self.v)[self.s]
        if 2 * self.m * self.V > 32767:
            raise ValueError(f"pipeline: {self.m} micro-batches x {self.V} stages exceed the MPI tag space")
        if self.V > 1 and act_shape is None:
            raise ValueError("pipeline: act_shape(k, rows) is needed to receive activations")
        self.act_shape, self.loss_fn, self.tied = act_shape, loss_fn, list(tied or ())
        self.dtype = self.chunks[0].parameters()[0].dtype
        self.emb_group = None
        if self.p > 1 and tied is not None:   # every stage passes tied (maybe []): split is collective
            ends = self.s in (0, self.p - 1)
            g = pp_group.split(0 if ends else 1, name="embedding")
            self.emb_group = g if ends else None
        self.timeline, self.peak_stash, self.losses = [], 0, []

    # ---------------------------------------------------------------- params
    def named_parameters(self):
        seen = set()
        for chunk in self.chunks:
            for name, prm in chunk.named_parameters():
                if id(prm) not in seen:
                    seen.add(id(prm))
                    yield name, prm

    def parameters(self):
        return [prm for _, prm in self.named_parameters()]

    def state_dict(self):
        return {name: np.array(prm.numpy()) for name, prm in self.named_parameters()}

    # ----------------------------------------------------------------- step
    def train_step(self, x, y, optimizer, timeline=False):
        """One optimizer step on this rank's batch (x, y), split into m micro-batches.
        Returns the loss (mean over the global batch) on every rank. With
        ``timeline=True`` the pp ranks first align clocks at a barrier and
        ``self.timeline`` holds (Instr, start, end) of every compute."""
        if len(x) % self.m:
            raise ValueError(f"pipeline: this rank's batch of {len(x)} rows does not split into "
                             f"{self.m} micro-batches; use a batch size divisible by m (x dp)")
        self._x, self._y, self._b, self._optimizer = x, y, len(x) // self.m, optimizer
        self._recvs, self._sends, self._stash, self._grads = {}, [], {}, {}
        self.losses, self.timeline, self.peak_stash = [], [], 0
        for prm in self.parameters():
            prm.grad = None
        if timeline:
            self.pg.barrier()
        self._t0 = trace.now()
        for ins in self.program:
            getattr(self, "_" + ins.op.lower())(ins)
        return self._global_loss()

    def _tag(self, kind, mb, k):
        return 2 * (mb * self.V + k) + (kind == "grad")

    def _rows(self, a, mb):
        return a[mb * self._b:(mb + 1) * self._b]

    def _wait(self, key):
        work, buf = self._recvs.pop(key)
        t0 = trace.now()
        work.wait()                                  # cooperative when ranks outnumber cores
        self.timeline.append((S.Instr("WAIT", key[1], key[2]), t0 - self._t0, trace.now() - self._t0))
        return buf

    def _recv(self, kind, ins):
        k = ins.chunk * self.p + self.s
        buf = xp.empty(self.act_shape(k if kind == "act" else k + 1, self._b), dtype=self.dtype)
        self._recvs[(kind, ins.mb, ins.chunk)] = (self.pg.irecv(buf, ins.peer, self._tag(kind, ins.mb, k)), buf)

    def _send(self, kind, ins, buf, k_to):
        buf = xp.ascontiguousarray(buf)
        self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]   # free finished sends
        self._sends.append((self.pg.isend(buf, ins.peer, self._tag(kind, ins.mb, k_to)), buf))

    def _recv_act(self, ins):
        self._recv("act", ins)

    def _recv_grad(self, ins):
        self._recv("grad", ins)

    def _send_act(self, ins):
        k = ins.chunk * self.p + self.s
        self._send("act", ins, self._stash[(ins.mb, ins.chunk)][1].data, k + 1)

    def _send_grad(self, ins):
        k = ins.chunk * self.p + self.s
        self._send("grad", ins, self._grads.pop((ins.mb, ins.chunk)), k - 1)

    def _forward(self, ins):
        mb, c = ins.mb, ins.chunk
        k = c * self.p + self.s
        x = self._rows(self._x, mb) if k == 0 else Tensor(self._wait(("act", mb, c)), requires_grad=True)
        t0 = trace.now()
        out = self.chunks[c](x)                                  # (b, T, C), or logits on the last stage
        if k == self.V - 1:
            out = self.loss_fn(out, self._rows(self._y, mb)) * (1.0 / self.m)   # mean over the batch
            self.losses.append(out.item())
        self._stash[(mb, c)] = (x, out)
        self.peak_stash = max(self.peak_stash, len(self._stash))
        self._done(ins, t0)

    def _backward(self, ins):
        mb, c = ins.mb, ins.chunk
        k = c * self.p + self.s
        g = None if k == self.V - 1 else self._wait(("grad", mb, c))
        t0 = trace.now()
        x, out = self._stash.pop((mb, c))                        # free the stash after its backward
        out.backward(g)
        if k > 0:
            self._grads[(mb, c)] = x.grad if x.grad is not None else xp.zeros_like(x.data)
        self._done(ins, t0)

    def _done(self, ins, t0):
        t1 = trace.now()
        self.timeline.append((ins, t0 - self._t0, t1 - self._t0))
        trace.record(f"{ins.op[0]}{ins.mb}.{ins.chunk}", "compute", t0, t1, mb=ins.mb, chunk=ins.chunk)

    def _optimizer_step(self, ins):
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        params = self.parameters()
        for prm in params:   # (a transposed use, like the head's wte^T, leaves an F-ordered .grad)
            prm.grad = xp.zeros_like(prm.data) if prm.grad is None else xp.ascontiguousarray(prm.grad)
        if self.emb_group is not None:
            for prm in self.tied:                                # dL/dwte = embedding part + head part
                self.emb_group.all_reduce(prm.grad, op="sum")
        if self.dp_group is not None and self.dp_group.size > 1:
            for prm in params:
                self.dp_group.all_reduce(prm.grad, op="avg")
        self._optimizer.step()

    def _global_loss(self):
        loss = xp.asarray([sum(self.losses)], dtype=np.float64)
        if self.s == self.p - 1 and self.dp_group is not None and self.dp_group.size > 1:
            self.dp_group.all_reduce(loss, op="avg")
        if self.p > 1:
            self.pg.broadcast(loss, src=self.p - 1)
        return float(loss[0])


def gather_timeline(pipe):
    """Every stage's measured [(Instr, start, end)] of the last ``train_step(...,
    timeline=True)``, in seconds from the step's aligned start, on pp rank 0 (None
    elsewhere). Collective over the pp group. Feed it to ``schedules.bubble_fraction``
    (measured idle per stage) or to pipeline_draw."""
    return pipe.pg.gather_object(pipe.timeline, dst=0)
