"""Data parallelism: every rank holds the whole model and trains on its slice of the batch.

The invariant. A global batch of B rows is cut into n equal shards of b = B/n rows
(``shard(batch)``: rank r takes rows [r b, (r+1) b)). Rank r's loss is the mean over
its own rows, L_r = (1/b) sum_{i in shard r} l_i, so

    g = (1/n) sum_r dL_r/dw = (1/B) sum_i dl_i/dw = dL/dw      (L = mean over the global batch)

i.e. averaging the ranks' gradients (all-reduce with op="avg") gives exactly the
gradient of single-process training on the global batch. Every rank then runs the
same optimizer step on the same gradient, so replicas that start identical stay
identical (broadcast from rank 0 at construction, or verified). With gradient
accumulation over k micro-batches, scale each micro-batch loss by 1/k (still the
global-batch mean) and all-reduce once, after the last one (``no_sync()``).

Communication: an all-reduce of S bytes costs 2(n-1)/n * S per rank in a ring, so
one step sends 2(n-1)/n * Psi * bytes_per_param per rank (the ZeRO paper's "2 Psi",
Rajbhandari et al. 2020), however the gradients are grouped.

Two implementations, with the one shape of every strategy (base.py, docs/design.md):

    model = DataParallel(GPT(cfg, seed), dp_group, bucket_cap_mb=25)   # or DataParallelNaive(...)
    opt = AdamW(model.parameters())
    x, y = model.local_batch(*data.get_batch(tokens, B, T, seed, step))   # rows [r B/n, (r+1) B/n)
    loss = model.forward_backward(x, y)     # backward; every p.grad is now the global-batch mean
    opt.step(); opt.zero_grad()

``microbatches=k`` on the wrapped strategy (or ``parallelize``) is gradient
accumulation: k backward passes, and the all-reduce follows the last one.

* ``DataParallelNaive`` -- for learning: after backward, all-reduce every gradient,
  one by one, nothing overlapped.
* ``DataParallel`` -- PyTorch DDP's design (Li et al., "PyTorch Distributed", VLDB
  2020): gradients live in flat buckets (``p.grad`` is a view into its bucket, so
  backward accumulates straight into the buffer that is sent); buckets are filled in
  reverse order of parameter registration (about the order backward produces
  gradients); the first one is small (``first_bucket_cap_mb``) so communication
  starts early; a bucket's asynchronous all-reduce is issued from the
  post-accumulate-grad hook of its last gradient (of the last micro-batch), while
  backward goes on computing the next buckets. Buckets are issued strictly in bucket
  order, so every rank issues the same collectives in the same order. When the
  wrapped strategy still changes gradients after backward (sequence parallelism's
  LayerNorm grads, a pipeline's tied embedding), every bucket is issued after that.

  The mean's 1/n. With n a power of two, g/n = g * 2^-k exactly (short of subnormals),
  so sum_r (g_r * 2^-k) has the bits of (sum_r g_r) * 2^-k. The hook therefore scales each parameter's
  finished gradient (after its last micro-batch) while backward has just written it,
  and the bucket's all-reduce is a plain sum: no pass over the whole bucket after the
  transfer (PyTorch's default comm hook divides before its all-reduce too). Other n,
  2-byte floats and late gradients keep ``op="avg"`` (x / n after the sum, group.py).
"""
import hashlib

from pdist.engine.backend import is_low, to_numpy, xp
from pdist.data import shard
from pdist.parallel.base import ParallelModule

MB = 1024 * 1024


class _DataParallelBase(ParallelModule):
    """What both implementations share: the group, the start-up check and sync of the
    replicas, this rank's rows of the batch, and the loss's weight 1/n."""

    def __init__(self, module, group=None, init_sync="broadcast"):
        if init_sync not in ("broadcast", "verify"):
            raise ValueError(f"init_sync must be 'broadcast' or 'verify', got {init_sync!r}")
        super().__init__(module, group)
        self.dp_rank, self.dp_world_size = self.group.rank, self.group.size
        self.loss_weight = 1.0 / self.dp_world_size
        self.inner.materialize()            # a meta model: every replica holds it whole
        self._param_list = self.parameters()
        self._check_same_model()
        if init_sync == "broadcast":
            for p in self._param_list:      # rank 0's weights everywhere (PyTorch DDP does the same)
                self.group.broadcast(p.data, src=0)
        else:
            self._verify_identical()

    def _check_same_model(self):
        """Every rank must hold the same parameter list (names, shapes, dtypes); raises
        on every rank, before any collective on tensors, when one differs."""
        sig = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.named_parameters()]
        sigs = self.group.all_gather_object(sig)
        bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
        if bad:
            diff = next((a, b) for a, b in zip(sigs[bad[0]] + [None], sigs[0] + [None]) if a != b)
            raise ValueError(f"{type(self).__name__}: ranks {bad} hold a different model than rank 0 "
                             f"(first difference: rank {bad[0]} has {diff[0]}, rank 0 has {diff[1]}). "
                             f"Build the same model (same config) on every rank.")

    def _verify_identical(self):
        """init_sync="verify": a digest of every parameter's bytes, compared across ranks."""
        mine = [hashlib.sha1(to_numpy(p.data).tobytes()).hexdigest() for p in self._param_list]
        all_ = self.group.all_gather_object(mine)
        names = [n for n, _ in self.named_parameters()]
        bad = sorted({names[i] for d in all_ for i, (a, b) in enumerate(zip(d, all_[0])) if a != b})
        if bad:
            raise ValueError(f"{type(self).__name__}(init_sync='verify'): replicas differ from rank 0 in "
                             f"{bad[:5]}{' ...' if len(bad) > 5 else ''}. Seed the model identically on "
                             f"every rank, or use init_sync='broadcast' to copy rank 0's weights.")

    def local_batch(self, x, y):
        """This rank's rows of the global batch: [r B/n, (r+1) B/n). Raises the same clear
        error on every rank when B does not divide by n."""
        return self.inner.local_batch(*shard((x, y), self.dp_rank, self.dp_world_size))


class DataParallelNaive(_DataParallelBase):
    """For learning: g_p <- (1/n) sum_r g_p^(r) for every parameter p, one blocking
    all-reduce per parameter, all after backward (no buckets, no overlap)."""

    def finish_grad_sync(self):
        """All-reduce (average) each parameter's gradient, one after the other."""
        self.inner.finish_grad_sync()
        for p in self._param_list:
            if p.grad is None:      # unused on this rank: contributes zeros (another rank may use it)
                p.grad = xp.zeros_like(p.data)
            elif not p.grad.flags.c_contiguous:   # a transposed use (the tied head) leaves an F-order grad
                p.grad = xp.ascontiguousarray(p.grad)
            self.group.all_reduce(p.grad, op="avg")


class _Bucket:
    """One flat gradient buffer and the parameters whose ``.grad`` are views into it."""

    def __init__(self, index, params):
        self.index, self.params = index, params
        self.buffer = xp.zeros(sum(p.size for p in params), dtype=params[0].dtype)  # (numel,)
        self.views, off = {}, 0
        for p in params:
            self.views[id(p)] = self.buffer[off:off + p.size].reshape(p.shape)
            off += p.size
        self.ready = {}        # id(param) -> backward passes that completed its gradient this step
        self.work = None       # the in-flight all-reduce
        self.scale = None      # 1/n applied by the hook (then the all-reduce sums), or None: op="avg"

    def complete(self, passes):
        return len(self.ready) == len(self.params) and min(self.ready.values()) >= passes


def build_buckets(params, bucket_cap_bytes, first_bucket_cap_bytes):
    """Group params, walked in reverse, into buckets of at most the cap (a larger
    parameter gets a bucket of its own); the first bucket uses the smaller cap.
    A bucket holds one dtype. Returns lists of params, bucket 0 first."""
    groups, cur, size = [], [], 0
    for p in reversed(params):
        cap = first_bucket_cap_bytes if not groups else bucket_cap_bytes
        if cur and (size + p.data.nbytes > cap or p.dtype != cur[0].dtype):
            groups.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.data.nbytes
    if cur:
        groups.append(cur)
    return groups


class DataParallel(_DataParallelBase):
    """Bucketed, overlapped data parallelism (PyTorch DDP's design; see the module doc).

    Invariant after ``finish_grad_sync()``: for every parameter p, p.grad =
    (1/n) sum_r g_p^(r) (the global-batch mean) and p.grad is a view into its
    bucket's buffer. ``bucket_cap_mb`` / ``first_bucket_cap_mb`` in MiB (PyTorch's
    defaults, 25 and 1). (How long the synchronization waits for the communication backward
    did not hide: pdist/measure/sync_wait.py.)"""

    def __init__(self, module, group=None, bucket_cap_mb=25, first_bucket_cap_mb=1, init_sync="broadcast"):
        if not (bucket_cap_mb > 0 and first_bucket_cap_mb > 0):
            raise ValueError(f"bucket caps must be > 0 MiB, got bucket_cap_mb={bucket_cap_mb}, "
                             f"first_bucket_cap_mb={first_bucket_cap_mb}")
        super().__init__(module, group, init_sync)
        groups = build_buckets(self._param_list, bucket_cap_mb * MB, first_bucket_cap_mb * MB)
        self.buckets = [_Bucket(i, ps) for i, ps in enumerate(groups)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0         # buckets [0, _next) are issued in this step
        self._overlap = not self.inner.has_late_grads
        n = self.dp_world_size
        if self._overlap and n > 1 and n & (n - 1) == 0:
            for b in self.buckets:           # 1/n = 2^-k is exact: scaled in the hook (module doc)
                dt = b.buffer.dtype
                b.scale = 1.0 / n if dt.kind == "f" and not is_low(dt) else None
        for p in self._param_list:
            p.grad = self._bucket_of[id(p)].views[id(p)]
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _into_bucket(self, p):
        """Make p.grad its bucket view (it is not after zero_grad(set_to_none=True))."""
        view = self._bucket_of[id(p)].views[id(p)]
        if p.grad is not view:
            if p.grad is None:
                view[...] = 0
            else:
                view[...] = p.grad
            p.grad = view

    def _on_grad_ready(self, p):
        """Post-accumulate-grad hook: p.grad is complete for this backward pass; after the
        last micro-batch's pass it is complete for the step."""
        b = self._bucket_of[id(p)]
        self._into_bucket(p)
        b.ready[id(p)] = passes = b.ready.get(id(p), 0) + 1
        if not self._overlap:
            return
        k = self.microbatches
        if b.scale is not None and passes == k:       # its last pass: g_r * 2^-k while it is hot
            p.grad *= b.scale
        while self._next < len(self.buckets) and self.buckets[self._next].complete(k):
            self._issue(self.buckets[self._next])
        for done in self.buckets[:self._next]:      # let MPI progress the in-flight ones
            done.work.is_completed()

    def _issue(self, b):
        b.work = self.group.all_reduce(b.buffer, op=self.sync_op(b), async_op=True)
        self._next += 1

    def finish_grad_sync(self):
        """Issue the buckets backward did not complete (parameters that got no gradient on
        this rank contribute zeros), wait for all."""
        self.inner.finish_grad_sync()
        for b in self.buckets[self._next:]:
            for p in b.params:
                self._into_bucket(p)
                if b.scale is not None and b.ready.get(id(p), 0) < self.microbatches:
                    p.grad *= b.scale             # unused in the last pass (or at all): not yet scaled
            self._issue(b)
        for b in self.buckets:
            b.work.wait()
            b.work = None
            b.ready.clear()
        self._next = 0

    @staticmethod
    def sync_op(b):
        """The all-reduce op of bucket ``b``: "sum" when the hook scaled it by 1/n, else "avg"."""
        return "avg" if b.scale is None else "sum"

    def zero_grad(self):
        """Zero the bucket buffers in place; every p.grad stays a view into its bucket
        (PyTorch's gradient_as_bucket_view)."""
        self.inner.zero_grad()
        for b in self.buckets:
            b.buffer[...] = 0
            b.ready.clear()
        for p in self._param_list:
            self._into_bucket(p)
        self._next = 0
