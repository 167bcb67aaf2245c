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

Two implementations, both used the same way:

    model = DataParallel(GPT(cfg, seed), bucket_cap_mb=25)   # or DataParallelNaive(...)
    x, y = model.shard(data.get_batch(tokens, B, T, seed, step))
    model.zero_grad()
    _, loss = model(x, y)
    loss.backward()                          # DataParallel: bucket all-reduces start in here
    model.finish_gradient_synchronization()  # wait: now every p.grad is the global mean
    opt.step()

* ``DataParallelNaive`` -- for learning: after backward, all-reduce every gradient,
  one by one, nothing overlapped.
* ``DataParallel`` -- PyTorch DDP's design (Li et al., "PyTorch Distributed", VLDB
  2020): gradients live in flat buckets (``p.grad`` is a view into its bucket, so
  backward accumulates straight into the buffer that is sent); buckets are filled in
  reverse order of parameter registration (about the order backward produces
  gradients); the first one is small (``first_bucket_cap_mb``) so communication
  starts early; a bucket's asynchronous all-reduce is issued from the
  post-accumulate-grad hook of its last gradient, while backward goes on computing
  the next buckets. Buckets are issued strictly in bucket order, so every rank
  issues the same collectives in the same order.
"""
import contextlib
import hashlib

from pdist import nn, trace
from pdist.backend import to_numpy, xp

MB = 1024 * 1024


class _DataParallelBase(nn.Module):
    """What both implementations share: the group, the start-up check and sync of the
    replicas, the batch shard, forward, and the ``no_sync()`` switch."""

    def __init__(self, module, group=None, init_sync="broadcast"):
        super().__init__()
        if group is None:
            from pdist import comm
            group = comm.get_world()
        if init_sync not in ("broadcast", "verify"):
            raise ValueError(f"init_sync must be 'broadcast' or 'verify', got {init_sync!r}")
        self.module, self.group = module, group
        self.dp_rank, self.dp_world_size = group.rank, group.size
        self._require_sync = True
        self._param_list = [p for p in module.parameters() if p.requires_grad]
        self._check_same_model()
        if init_sync == "broadcast":
            for p in self._param_list:      # rank 0's weights everywhere (PyTorch DDP does the same)
                group.broadcast(p.data, src=0)
        else:
            self._verify_identical()

    def _check_same_model(self):
        """Every rank must hold the same parameter list (names, shapes, dtypes); raises
        on every rank, before any collective on tensors, when one differs."""
        sig = [(n, tuple(p.shape), str(p.dtype))
               for n, p in self.module.named_parameters() if p.requires_grad]
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
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        bad = sorted({names[i] for d in all_ for i, (a, b) in enumerate(zip(d, all_[0])) if a != b})
        if bad:
            raise ValueError(f"{type(self).__name__}(init_sync='verify'): replicas differ from rank 0 in "
                             f"{bad[:5]}{' ...' if len(bad) > 5 else ''}. Seed the model identically on "
                             f"every rank, or use init_sync='broadcast' to copy rank 0's weights.")

    def forward(self, *args, **kw):
        return self.module(*args, **kw)

    def shard(self, batch):
        """This rank's rows of a global batch (tuple of arrays of B rows): [r B/n, (r+1) B/n).
        Raises the same clear error on every rank when B does not divide by n."""
        from pdist.data import shard
        return shard(batch, self.dp_rank, self.dp_world_size)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate into ``p.grad`` locally; the
        first backward after it (outside) all-reduces the accumulated sum once."""
        prev, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = prev

    def _not_in_no_sync(self, what):
        if not self._require_sync:
            raise RuntimeError(f"{what} inside no_sync(): run the last micro-batch's backward "
                               f"outside the no_sync() block, then synchronize")


class DataParallelNaive(_DataParallelBase):
    """For learning: g_p <- (1/n) sum_r g_p^(r) for every parameter p, one blocking
    all-reduce per parameter, all after backward (no buckets, no overlap)."""

    def finish_gradient_synchronization(self):
        """All-reduce (average) each parameter's gradient, one after the other."""
        self._not_in_no_sync("finish_gradient_synchronization()")
        t0 = trace.now()
        for p in self._param_list:
            if p.grad is None:      # unused on this rank: contributes zeros (another rank may use it)
                p.grad = xp.zeros_like(p.data)
            self.group.all_reduce(p.grad, op="avg")
        self.last_wait_seconds = trace.now() - t0


class _Bucket:
    """One flat gradient buffer and the parameters whose ``.grad`` are views into it."""

    def __init__(self, index, params):
        self.index, self.params = index, params
        self.buffer = xp.zeros(sum(p.size for p in params), dtype=params[0].dtype)  # (numel,)
        self.views, off = {}, 0
        for p in params:
            self.views[id(p)] = self.buffer[off:off + p.size].reshape(p.shape)
            off += p.size
        self.ready = set()     # ids of params whose gradient is complete in this backward
        self.work = None       # the in-flight all-reduce


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

    Invariant after ``finish_gradient_synchronization()``: for every parameter p,
    p.grad = (1/n) sum_r g_p^(r) (the global-batch mean) and p.grad is a view into
    its bucket's buffer. ``bucket_cap_mb`` / ``first_bucket_cap_mb`` in MiB (PyTorch's
    defaults, 25 and 1). ``last_wait_seconds``: time the last synchronization spent
    waiting for communication that backward had not hidden."""

    def __init__(self, module, group=None, bucket_cap_mb=25, first_bucket_cap_mb=1, init_sync="broadcast"):
        if not (bucket_cap_mb > 0 and first_bucket_cap_mb > 0):
            raise ValueError(f"bucket caps must be > 0 MiB, got bucket_cap_mb={bucket_cap_mb}, "
                             f"first_bucket_cap_mb={first_bucket_cap_mb}")
        super().__init__(module, group, init_sync)
        groups = build_buckets(self._param_list, bucket_cap_mb * MB, first_bucket_cap_mb * MB)
        self.buckets = [_Bucket(i, ps) for i, ps in enumerate(groups)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0         # buckets [0, _next) are issued in this backward
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
        """Post-accumulate-grad hook: p.grad is complete for this backward."""
        b = self._bucket_of[id(p)]
        if b.work is not None:
            raise RuntimeError("backward() ran again while this step's gradient all-reduces are in flight: "
                               "call model.finish_gradient_synchronization() after each backward, or wrap "
                               "all but the last micro-batch's backward in model.no_sync()")
        self._into_bucket(p)
        if not self._require_sync:
            return
        b.ready.add(id(p))
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._issue(self.buckets[self._next])
        for done in self.buckets[:self._next]:      # let MPI progress the in-flight ones
            done.work.is_completed()

    def _issue(self, b):
        t = trace.now()
        trace.record("dp.issue_bucket", "dp", t, t, bucket=b.index, bytes=int(b.buffer.nbytes))
        b.work = self.group.all_reduce(b.buffer, op="avg", async_op=True)
        self._next += 1

    def forward(self, *args, **kw):
        if any(b.work is not None for b in self.buckets):
            raise RuntimeError("forward() while the previous step's gradient all-reduces are still in "
                               "flight: call model.finish_gradient_synchronization() after loss.backward() "
                               "and before optimizer.step()")
        return self.module(*args, **kw)

    def finish_gradient_synchronization(self):
        """Issue the buckets backward did not complete (parameters that got no gradient on
        this rank contribute their current .grad, zeros after zero_grad), wait for all."""
        self._not_in_no_sync("finish_gradient_synchronization()")
        for b in self.buckets[self._next:]:
            for p in b.params:
                self._into_bucket(p)
            self._issue(b)
        t0 = trace.now()
        for b in self.buckets:
            b.work.wait()
            b.work = None
            b.ready.clear()
        self._next = 0
        self.last_wait_seconds = trace.now() - t0

    def zero_grad(self, set_to_none=False):
        """Zero the bucket buffers in place; every p.grad stays a view into its bucket
        (PyTorch's gradient_as_bucket_view). ``set_to_none`` is accepted and ignored."""
        for b in self.buckets:
            b.buffer[...] = 0
        for p in self._param_list:
            self._into_bucket(p)
