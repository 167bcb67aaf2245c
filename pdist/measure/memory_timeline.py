"""A memory timeline of one training step, per rank: bytes by category at every
memory event, stacked, with the events marked (the picture of ZeRO's schedule that
Rajbhandari et al., 2020, describe in words: stage 3 gathers a unit, uses it, frees it).

    with memory_timeline.record(model, optimizer) as tl:     # the model of the one shape
        train(model, optimizer, get_batch, 1)
    tl.samples          # [(t, event, unit, params, grads, optim, activations, rss)]
    memory_timeline.plot(world.gather_object(tl.samples), "step.png")   # matplotlib, optional

Each sample is taken at an *event* (ZeRO announces them through the step hooks,
pdist/engine/hooks.py ``event``: ``all-gather`` when a unit's parameters arrive,
``free`` when they are dropped, ``reduce-scatter`` when a unit's gradient shard is
reduced, ``all-reduce`` at stage 0), at the end of each phase of the step (event
``zero_grad``, ``compute``, ``grad_sync``, ``stats``) and at the record's start and end.
The record subscribes to the step hooks on entry and leaves on exit: no timeline, no cost.

    params, grads, optim   pdist.measure.memory.model_state_bytes (live buffers, each once)
    activations            tracemalloc's current bytes - (params + grads + optim) -
                           what was traced before the step: the activations the graph
                           keeps, plus the step's temporaries. On a GPU the live bytes of
                           CuPy arrays instead, from a ``cupy.cuda.MemoryHook``
                           (pdist/measure/device_memory.py), with the same subtraction
    rss                    the process's resident set (pdist.measure.memory.rss_bytes)

On a GPU ``tl.device`` holds, per sample, {"live_bytes", "peak_bytes" (the hook's high-water
mark so far), "pool_held_bytes"} (no synchronization at a sample: the hook counts
allocations as the host issues them, which is when CuPy's pool hands memory out), and
``tl.device_row`` the whole block's row at exit (the pool's growth, the driver's mem_info
delta, what NCCL and cuBLAS took outside the pool).

Every sample also goes into the trace (pdist.measure.trace): a ``memory`` counter (``"ph": "C"``,
Perfetto stacks its values) and an instant event named after the event, so
``--trace`` shows the timeline beside the collectives. Recording walks the model's
arrays at each event and traces allocations, so it is for one diagnostic step, not
for timing.
"""
import time
import tracemalloc

from pdist.engine.backend import is_gpu
from pdist.engine import hooks
from pdist.measure import trace
from pdist.measure.memory import model_state_bytes, rss_bytes

EVENTS = ("all-gather", "free", "reduce-scatter", "all-reduce")


def mark(event, unit=None):
    """A memory event: ``hooks.event`` (a no-op unless a timeline is recording)."""
    hooks.event(event, unit)


class _Sampler(hooks.StepHook):
    """The record's step hook: a sample at every memory event and after every phase."""

    def __init__(self, tl):
        self.tl = tl

    def event(self, name, unit=None):
        self.tl.sample(name, unit)

    def exit(self, s, phase):
        self.tl.sample(phase)


class record:
    """``with record(model, optimizer) as tl:`` samples memory at every event inside."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer, self.samples, self.device = model, optimizer, [], []
        self._hook, self._dm, self.device_row = _Sampler(self), None, None

    def _current(self):
        """Bytes allocated now: the MemoryHook's live bytes on a GPU, tracemalloc's on the host."""
        if self._dm is not None:
            return self._dm.live_bytes
        return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0

    def sample(self, event, unit=None):
        st = model_state_bytes(self.model, self.optimizer)
        cur = self._current()
        states = st["params_bytes"] + st["grads_bytes"] + st["optim_bytes"]
        act = max(0, cur - self._traced0 - (states - self._states0))
        rss = rss_bytes() or 0
        self.samples.append((time.perf_counter() - self._t0, event, unit, st["params_bytes"], st["grads_bytes"],
                             st["optim_bytes"], act, rss))
        trace.counter("memory", params=st["params_bytes"], grads=st["grads_bytes"], optim=st["optim_bytes"],
                      activations=act)
        if self._dm is not None:
            import cupy
            self.device.append({"live_bytes": cur, "peak_bytes": self._dm.peak_bytes,
                                "pool_held_bytes": int(cupy.get_default_memory_pool().total_bytes())})
        if event in EVENTS:
            trace.instant(event, cat="memory", unit=str(unit))

    def __enter__(self):
        if is_gpu():
            from pdist.measure.device_memory import DeviceMemory
            self._dm = DeviceMemory().__enter__()
        elif not tracemalloc.is_tracing():
            tracemalloc.start()
        self._t0 = time.perf_counter()
        st = model_state_bytes(self.model, self.optimizer)
        self._states0 = st["params_bytes"] + st["grads_bytes"] + st["optim_bytes"]
        self._traced0 = self._current()
        self.sample("start")
        hooks.subscribe(self._hook)
        return self

    def __exit__(self, *exc):
        hooks.unsubscribe(self._hook)
        self.sample("end")
        if self._dm is not None:
            self._dm.__exit__(*exc)
            self.device_row = self._dm.row()
        return False

    def events(self, kind=None):
        """[(event, unit)] in order (``kind``: only that event)."""
        return [(e, u) for _, e, u, *_ in self.samples if kind is None or e == kind]


COLORS = {"all-gather": "tab:blue", "free": "tab:red", "reduce-scatter": "tab:green", "all-reduce": "tab:olive"}


def plot(per_rank, path, title="memory over one step"):
    """One panel per rank: params, grads, optimizer state and activations stacked (MiB)
    against time, RSS above its value at the start as a line, events as vertical marks.
    ``per_rank``: [samples of rank 0, of rank 1, ...]. Returns False (and writes nothing)
    without matplotlib (the optional extra ``pdist[plot]``), else True."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    mib = 1 / 2 ** 20
    fig, axes = plt.subplots(len(per_rank), 1, figsize=(10, 2.6 * len(per_rank)), squeeze=False, sharex=True)
    for r, (ax, samples) in enumerate(zip(axes[:, 0], per_rank)):
        t = [s[0] * 1e3 for s in samples]
        layers = [[s[i] * mib for s in samples] for i in (3, 4, 5, 6)]
        ax.stackplot(t, *layers, labels=["params", "grads", "optimizer (m, v)", "activations"], step="post",
                     alpha=0.8)
        rss0 = samples[0][7]
        ax.plot(t, [(s[7] - rss0) * mib + sum(v[0] for v in layers) for s in samples], "k--", lw=1,
                drawstyle="steps-post", label="RSS (shifted to the states at the start)")
        for ts, s in zip(t, samples):
            if s[1] in COLORS:
                ax.axvline(ts, color=COLORS[s[1]], lw=0.6, alpha=0.7)
        ax.set_ylabel(f"rank {r}  MiB")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], color=c, lw=1) for c in COLORS.values()]
    fig.legend(handles, labels + list(COLORS), fontsize=7, loc="lower center", ncol=5)
    axes[-1, 0].set_xlabel("ms since the step began")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
