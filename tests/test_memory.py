"""pdist.measure.memory: distinct-buffer byte counts, the tracemalloc peak, the process's RSS (single process);
and the meta-device init of pdist/engine/meta.py."""
import numpy as np
import pytest

from pdist.engine import host_memory, meta
from pdist.models import gpt
from pdist.course import lesson
from pdist.measure import memory
from pdist.engine.autograd import Tensor


def test_views_count_their_buffer_once():
    flat = np.zeros(1000)                       # 8000 B
    a, b = flat[:300].reshape(10, 30), flat[300:]
    other = np.zeros(10, dtype=np.float32)      # 40 B
    assert memory.unique_nbytes([a, b, flat, other, None]) == 8000 + 40
    assert memory.unique_nbytes([a]) == 8000    # a view counts the whole buffer it lives in


def test_model_state_bytes_of_a_plain_model_and_adamw():
    cfg = gpt.GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype="float32")
    model = gpt.GPT(cfg, seed=0)
    psi = cfg.num_params()
    opt = lesson.make_adamw(model.parameters())
    before = memory.model_state_bytes(model, opt)
    assert before == {"params_bytes": 4 * psi, "grads_bytes": 0, "optim_bytes": 0}
    _, loss = model(np.zeros((2, 8), dtype=np.int64), np.ones((2, 8), dtype=np.int64))
    loss.backward()
    opt.step()
    assert memory.model_state_bytes(model, opt) == {"params_bytes": 4 * psi, "grads_bytes": 4 * psi,
                                                    "optim_bytes": 8 * psi}


def test_peak_sees_a_temporary_that_is_already_freed():
    memory.start_tracing(restart=True)
    keep = np.ones(1000)
    with memory.PeakMemory() as quiet:
        np.ones(10).sum()
    with memory.PeakMemory() as pk:
        t = np.ones(1_000_000)                  # 8 MB, freed before the block ends
        del t
    memory.stop_tracing()
    assert pk.peak_bytes >= 8_000_000 + keep.nbytes
    assert quiet.peak_bytes < 1_000_000


def test_memory_row_fields():
    t = Tensor(np.zeros(4), requires_grad=True)

    class M:
        def parameters(self):
            return [t]
    row = memory.memory_row(3, M(), None, peak_bytes=123)
    assert row == {"rank": 3, "params_bytes": 32, "grads_bytes": 0, "optim_bytes": 0, "peak_bytes": 123}


# --- what the process holds (RSS) and the allocator policy (pdist.engine.host_memory.tune_malloc) -----------
def test_rss_rises_with_an_array_and_falls_when_it_is_freed():
    """tune_malloc's fixed mmap threshold: a large array is its own mapping, so freeing it
    returns its pages to the OS at once (what ZeRO's frees rely on to show in the RSS)."""
    if memory.rss_bytes() is None:
        pytest.skip("no /proc/self/status here")
    before = memory.rss_bytes()
    a = np.ones(16 << 20)                            # 128 MiB, every page touched
    held = memory.rss_bytes()
    del a
    after = memory.rss_bytes()
    assert held - before >= 120 << 20, (before, held)
    assert held - after >= 120 << 20, (held, after)


def test_rss_peak_sees_a_freed_temporary_and_resets():
    if not memory.reset_rss_peak():
        pytest.skip("the RSS peak cannot be reset here (no /proc/self/clear_refs)")
    with memory.RSSPeak() as rp:
        # 64 MiB in a mapping of its own (new pages, whatever free heap a long-lived pytest
        # worker holds), every page touched, unmapped inside the block
        t = host_memory.mapped_empty(8 << 20, np.float64)
        t[:] = 1.0
        del t
    with memory.RSSPeak() as quiet:
        np.ones(10).sum()
    assert rp.exact and rp.peak_bytes - rp.rss_bytes >= 60 << 20, (rp.peak_bytes, rp.rss_bytes)
    assert quiet.peak_bytes - quiet.rss_bytes < 8 << 20, (quiet.peak_bytes, quiet.rss_bytes)


def test_process_row_and_malloc_free_bytes():
    row = memory.process_row()
    assert set(row) == {"rss_bytes", "rss_peak_bytes", "malloc_free_bytes"}
    if row["rss_bytes"] is not None:
        assert 0 < row["rss_bytes"] <= row["rss_peak_bytes"]
    free = host_memory.malloc_free_bytes()
    assert free is None or free >= 0


# --- meta init (pdist/engine/meta.py) --------------------------------------------------------------------
CFG = gpt.GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float32")


@pytest.mark.parametrize("chunk", [1, 7, 1 << 16])
def test_row_stream_equals_gpt_init_to_the_bit(monkeypatch, chunk):
    """The generator gives the same normals in chunks as in one call: rows [a, b) of the
    stream are gpt_init's rows, asked in order, skipped ahead, or restarted."""
    monkeypatch.setattr(meta, "CHUNK_ELEMS", chunk)
    for name, shape in CFG.param_shapes().items():
        full = gpt.gpt_init(CFG, name, seed=5)
        s = gpt.gpt_init_stream(CFG, name, seed=5)
        n = shape[0]
        parts = [s.rows(0, n // 3), s.rows(n // 3, n)]            # in order
        assert np.array_equal(np.concatenate(parts), full), name
        assert np.array_equal(s.rows(n // 2, n), full[n // 2:]), name   # restart, skip ahead


def test_meta_gpt_holds_no_values_and_materializes_bit_identical(monkeypatch):
    monkeypatch.setattr(meta, "CHUNK_ELEMS", 5)
    m = gpt.GPT(CFG, seed=5, device="meta")
    assert all(meta.is_meta(p.data) for p in m.parameters())
    assert memory.model_state_bytes(m)["params_bytes"] == 0
    with pytest.raises(TypeError, match="materialize"):
        m(np.zeros((1, 8), dtype=np.int64))
    m.materialize()
    ref = gpt.GPT(CFG, seed=5)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.data.dtype == q.data.dtype and np.array_equal(p.data, q.data), n
    with pytest.raises(ValueError, match="meta"):
        gpt.GPT(CFG, seed=5, device="cuda")


def test_mapped_empty_returns_its_pages_at_once_and_is_traced():
    """ZeRO's buffers (host_memory.mapped_empty): freeing one lowers the RSS by its size even where
    malloc keeps a freed heap array of the same size mapped (tune_malloc's policy keeps the
    heap's free pages), and tracemalloc counts it while it lives, as it counts NumPy's arrays."""
    import tracemalloc
    if memory.rss_bytes() is None:
        pytest.skip("no /proc/self/status here")
    n = 3 << 20                                      # 24 MiB of float64: under the 32 MiB mmap threshold
    tracemalloc.start()
    try:
        t0 = tracemalloc.get_traced_memory()[0]
        a = host_memory.mapped_empty(n, np.float64)
        a[...] = 1.0                                 # every page touched
        view = a[1:]                                 # a view keeps the mapping alive
        traced = tracemalloc.get_traced_memory()[0] - t0
        del a
        held = memory.rss_bytes()
        del view
        freed = held - memory.rss_bytes()
    finally:
        tracemalloc.stop()
    assert traced >= 8 * n, traced
    assert freed >= 8 * n - (1 << 20), (freed, held)


# --- ZeRO's buffer pool (host_memory.BufferPool) and the RSS of the documented path ----------------------
def test_buffer_pool_reuses_only_unviewed_buffers_and_malloc_trim_empties_it():
    """A freed buffer that a graph node still views holds its unit's values: it goes back only to
    the unit that freed it (``prefer``), never to another; one nothing views is reused; the
    pool's free buffers are held bytes, and malloc_trim returns them."""
    pool = host_memory.BufferPool()
    a = pool.take(1 << 15, np.float32)
    a[:] = 1.0
    view = a[3:5]                                  # a node still views a
    pool.give(a)
    assert host_memory.held_bytes() >= a.nbytes and pool.held_bytes() == a.nbytes
    b = pool.take(1 << 15, np.float32)
    assert b is not a and view[0] == 1.0           # another unit does not get the viewed buffer
    assert pool.take(1 << 15, np.float32, prefer=a) is a   # the unit that freed it does
    pool.give(a)
    pool.give(b)
    del view, b
    c = pool.take(1 << 15, np.float32)             # nothing views either one now: reused
    assert c is a or pool.held_bytes() == a.nbytes
    pool.give(c)
    host_memory.malloc_trim()
    assert pool.held_bytes() == 0 and host_memory.held_bytes() == 0


def test_rss_on_the_documented_path_within_15_percent_at_every_stage():
    """One 4-rank launch, ZeRO 0-3 through parallelize(GPT(cfg, seed)): allocated RSS (held
    memory split off) within 15% of the formula; right after parallelize at most the formula; the
    planner's model states, ZeRO pool and baseline within 15% of allocated, the pool, the RSS before."""
    from pathlib import Path
    from pdist.testing import mpirun, reports
    worker = Path(__file__).resolve().parent / "workers" / "zero_rss.py"
    got = {r["case"]: r for r in reports(mpirun(4, worker, "4", "256", timeout=240))}
    assert set(got) == {f"stage {s}" for s in range(4)}, got
    for r in got.values():              # the planner's memory (pdist.plan, ``this``) was set beside each row
        assert {"planned_allocated", "planned_pool", "planned_base"} <= set(r), r
