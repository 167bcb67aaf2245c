"""The deterministic mode (issue 28, items 1-2): the same bits on every layout.

One process: the granule tree's shape does not depend on the order of its leaves; BLAS
gives one row's bits whatever the thread count at a fixed shape (what the mode relies on);
Local(deterministic=True) at microbatches 1, 2, 4 equal bit for bit, where the default mode
does not; every layout the mode refuses names its reason. Under mpiexec (one launch of 4
ranks, tests/workers/deterministic.py): dp 2 and 4 with m in {1, 2, 4}, ZeRO 1-3 at dp 2 and
4, pp 2 under every schedule, dp 2 x pp 2, tp 2 and tp 2 + SP, float32 and bf16, against one
process, and the default mode's control; and one launch of 8 ranks: dp 2 x tp 2 x pp 2."""
import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from pdist import data
from pdist.course import lesson
from pdist.engine import precision
from pdist.models import registry
from pdist.models.gpt import GPT
from pdist.parallel import Local, MixedPrecision
from pdist.parallel.deterministic import Deterministic, GranuleTree, check_layout
from pdist.parallel.deterministic.blocks import Fan, tree_sum
from pdist.testing import mpirun, reports
from pdist.training import train
from shared_launch import own, world

T, SEED = 8, 3
CFG = lesson.gpt_config(64, block_size=T, n_layer=2, n_head=2, n_embd=16)


def test_tree_is_the_same_in_any_order():
    """Leaves in any order, or as two aligned halves joined: the bits of the balanced tree."""
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(64).astype(np.float32) * 10.0 ** rng.integers(-4, 4) for _ in range(8)]

    def tree(order):
        t = GranuleTree()
        for j in order:
            t.add(j, leaves[j].copy())
        return t.root()

    level, index, want = tree(range(8))
    assert (level, index) == (3, 0)
    for order in ([7, 6, 5, 4, 3, 2, 1, 0], list(rng.permutation(8))):
        assert np.array_equal(tree(order)[2], want)
    lo, hi = GranuleTree(), GranuleTree()          # two ranks' subtrees, joined as the root's children
    for j in range(4):
        lo.add(j, leaves[j].copy())
        hi.add(j + 4, leaves[j + 4].copy())
    assert np.array_equal(lo.root()[2] + hi.root()[2], want)
    chain = leaves[0].copy()                       # the left-to-right chain is another tree: other bits
    for v in leaves[1:]:
        chain = chain + v
    assert not np.array_equal(chain, want)
    bad = GranuleTree()
    for j in (1, 2):                               # not an aligned block
        bad.add(j, leaves[j].copy())
    with pytest.raises(ValueError, match="aligned subtree"):
        bad.root()


def test_fan_sums_a_shared_input_in_one_order():
    """A shared input read by 3 column layers in 4 blocks (Llama's q, k, v at tp_blocks 4): dX is
    tree_k ((g_k,q + g_k,k) + g_k,v) whichever order the slots' gradients arrive in; the last
    slot returns it, the others None. The chain in arrival order is another sum (other bits)."""
    rng = np.random.default_rng(2)
    g = {(k, c): (rng.standard_normal(256) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
         for k in range(4) for c in range(3)}
    want = tree_sum([(g[(k, 0)] + g[(k, 1)]) + g[(k, 2)] for k in range(4)])
    for order in (sorted(g), sorted(g, reverse=True), [tuple(x) for x in rng.permutation(list(g))]):
        fan = Fan(4, 3)
        outs = [fan.add(key, g[key]) for key in order]
        assert all(o is None for o in outs[:-1]) and np.array_equal(outs[-1], want)
    chain = g[(0, 0)]
    for key in sorted(g)[1:]:
        chain = chain + g[key]
    assert not np.array_equal(chain, want)


def test_blas_bits_at_a_fixed_shape():
    """The mode gives every BLAS call a granule's fixed shape and runs BLAS on one thread
    (``exact_kernels``), so it needs only: on one thread, the same shape and data give the same
    bits. It does NOT need a row's bits to be independent of the rows (or columns) around it,
    nor of the thread count: OpenBLAS picks other kernels for other shapes, and its Haswell
    sgemm (AMD EPYC without AVX-512) gives other bits at 2 threads (the report below)."""
    from pdist.parallel.deterministic import exact_kernels
    rng = np.random.default_rng(1)
    moved = []
    for M, K, N in [(T, 16, 48), (4 * T, 16, 64), (512, 64, 256)]:
        x, w = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)
        g = rng.standard_normal((M, N), dtype=np.float32)
        y, gw = x @ w, x.T @ g                                 # the process's own thread count
        with exact_kernels():
            assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {1}
            y1, gw1 = x @ w, x.T @ g
            assert np.array_equal(x @ w, y1) and np.array_equal(x.T @ g, gw1), (M, K, N)
        moved += [(M, K, N)] if not (np.array_equal(y, y1) and np.array_equal(gw, gw1)) else []
    x = rng.standard_normal((1024, 256), dtype=np.float32)
    w = rng.standard_normal((256, 1024), dtype=np.float32)
    rows_free = np.array_equal(x[:3] @ w, (x @ w)[:3])
    print(f"a row's bits independent of the rows around it (1024x256 @ 256x1024): {rows_free}; "
          f"shapes whose bits the thread count moved: {moved}")


def test_exact_scatter_gives_a_vocabulary_shard_one_processs_rows():
    """The embeddings' gradient in the mode (backend.scatter_add, exact_rows): the rows a
    vocabulary-parallel rank owns (its tokens' values, zeros for the tokens it does not own,
    all at its local row 0) get the bits one process gives them; the one-hot GEMM and reduceat
    do not promise it (they missed on OpenBLAS's Haswell sgemm: tp's embeddings parted)."""
    from pdist.engine.backend import scatter_add
    rng = np.random.default_rng(0)
    for N, t in [(8, 2), (32, 2), (64, 4), (512, 2), (512, 4)]:
        V, C = 64, 16
        n, idx = V // t, rng.integers(0, V, N)
        g = rng.standard_normal((N, C)).astype(np.float32)
        one = np.zeros((V, C), np.float32)
        scatter_add(one, idx, g, exact_rows=True)
        seq = np.zeros((V, C), np.float32)
        for i in range(N):                                   # the definition: one by one, in token order
            seq[idx[i]] += g[i]
        assert np.array_equal(one, seq), (N, t)
        for r in range(t):
            keep = (idx >= r * n) & (idx < (r + 1) * n)
            shard = np.zeros((n, C), np.float32)
            scatter_add(shard, np.where(keep, idx - r * n, 0), g * keep[:, None], exact_rows=True)
            assert np.array_equal(shard, one[r * n:(r + 1) * n]), (N, t, r)


@pytest.mark.parametrize("threads", [1, 2])
def test_blas_stack_slices_are_the_granules_own_gemms(threads):
    """What the batched pass (pdist/parallel/deterministic/granules.py) relies on: NumPy's matmul of a stack
    (G, n, K) @ (K, N) runs one gemm per slice with the slice's shape, so slice j has the bits
    of granule j's own 2-D product; the same for dX = G W^T, both dW (X^T G, G^T X: per-granule
    stacks), the bias's 1^T G, and a row's gemv (LayerNorm's g @ w) whatever rows surround it."""
    rng = np.random.default_rng(2)
    with threadpool_limits(threads):
        for G, n, K, N in [(16, T, 16, 48), (8, 4 * T, 64, 256), (4, 256, 128, 384)]:
            x, w = rng.standard_normal((G, n, K), dtype=np.float32), rng.standard_normal((K, N), dtype=np.float32)
            g, ones = rng.standard_normal((G, n, N), dtype=np.float32), np.ones(n, dtype=np.float32)
            wt = np.ascontiguousarray(w.T)                                    # (N, K): the out_in layout
            stacks = [(x @ w, lambda j: x[j] @ w), (x @ wt.T, lambda j: x[j] @ wt.T), (g @ w.T, lambda j: g[j] @ w.T),
                      (np.swapaxes(x, -1, -2) @ g, lambda j: x[j].T @ g[j]),
                      (np.swapaxes(g, -1, -2) @ x, lambda j: g[j].T @ x[j]), (ones @ g, lambda j: ones @ g[j]),
                      ((g.reshape(-1, N) @ w[0]).reshape(G, n), lambda j: g[j] @ w[0])]
            for i, (stack, own) in enumerate(stacks):
                assert all(np.array_equal(stack[j], own(j)) for j in range(G)), (i, G, n, K, N)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_batched_pass_has_the_loops_bits(model, monkeypatch):
    """The batched pass (one forward/backward over the granules, per-granule GEMMs and gradient
    stacks) against one pass per granule (``batched=False``): params, Adam m, v and the losses
    np.array_equal, fp32 and bf16, micro-batches 2; and in chunks of 2 granules (a small
    ``STACK_BYTES``), the memory bound. GPT-2 runs its tp blocks (one process), Llama its
    RMSNorm, RoPE, SwiGLU, grouped-query attention."""
    from pdist.parallel.deterministic import batched as deterministic_batched
    cfg = CFG if model == "gpt" else lesson.gpt_config(64, model="llama", block_size=T, n_layer=2, n_head=2, n_embd=16)
    for prec in ("fp32", "bf16"):
        loop = run_local(2, Deterministic(8, batched=False), prec, steps=2, cfg=cfg)
        assert same(run_local(2, Deterministic(8), prec, steps=2, cfg=cfg), loop), (model, prec)
    psi = sum(p.size for p in registry.build(cfg, SEED).parameters())
    monkeypatch.setattr(deterministic_batched, "STACK_BYTES", 2 * 4 * psi)       # chunks of 2 granules
    assert deterministic_batched.chunk_of(8, [psi]) == 2
    assert same(run_local(2, Deterministic(8), prec, steps=2, cfg=cfg), loop), (model, prec, "chunks")


def run_local(m, det, prec="fp32", steps=4, B=16, cfg=CFG):
    mod = registry.build(cfg, SEED)
    mod = mod if prec == "fp32" else precision.cast_module(mod, prec)
    s = Local(mod, m, deterministic=det)
    s = s if prec == "fp32" else MixedPrecision(s, prec)
    opt = lesson.make_adamw(s.parameters())
    tokens, _ = data.char_dataset(20_000)
    losses = train(s, opt, data.batch_fn(tokens, B, T, SEED, CFG.vocab_size), steps)
    state = {f"{k}.{id_}": np.array(v) for id_, st in enumerate(opt.state.values()) for k, v in st.items()
             if k != "step"}
    return {**{k: np.array(v) for k, v in s.full_state_dict().items()}, **state, "losses": np.array(losses)}


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_one_process_cp_chunks():
    """One process with cp_chunks = 2 (the leaves a cp 2 layout holds, pdist/parallel/deterministic/context.py):
    the same training as the plain tree (losses to rtol 1e-5), other bits (another tree); m = 2 gives
    its bits; the loop (batched=False) is refused, naming the option. Under mpiexec: the 4-rank launch."""
    chunks = run_local(1, dict(granules=4, cp_chunks=2), steps=2)
    plain = run_local(1, dict(granules=4), steps=2)
    np.testing.assert_allclose(chunks["losses"], plain["losses"], rtol=1e-5)
    assert not same(chunks, plain) and same(run_local(2, dict(granules=4, cp_chunks=2), steps=2), chunks)
    with pytest.raises(ValueError, match="drop batched=False"):
        run_local(1, dict(granules=4, cp_chunks=2, batched=False), steps=1)


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_local_microbatches_same_bits(prec):
    """m = 1, 2, 4 micro-batches: the same bits (params, Adam m, v) in the mode; the default
    mode's m = 1 and m = 4 differ (so the mode is what makes them equal)."""
    ref = run_local(1, True, prec)
    assert all(same(run_local(m, True, prec), ref) for m in (2, 4))
    default = run_local(1, False, prec)
    assert not same(default, run_local(4, False, prec))
    # the same training as the default mode (another summation order): the losses agree closely
    np.testing.assert_allclose(ref["losses"], default["losses"], rtol=1e-5 if prec == "fp32" else 2e-3)


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_llama_microbatches_same_bits(prec):
    """Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention): m = 1 and 4 give the same bits."""
    cfg = lesson.gpt_config(64, model="llama", block_size=T, n_layer=2, n_head=2, n_embd=16)
    assert same(run_local(4, True, prec, cfg=cfg), run_local(1, True, prec, cfg=cfg))


def test_refusals_name_the_reason():
    det = Deterministic()
    moe = lesson.gpt_config(64, block_size=T, n_layer=2, n_head=2, n_embd=16, n_expert=4)
    for kw, match in [(dict(cfg=moe, pp=2, microbatches=16), "under a pipeline"),
                      (dict(cfg=moe, tp=2), "cuts experts")]:
        with pytest.raises(ValueError, match=match):
            check_layout(det, **{"dp": 1, **kw})
    for kw, match in [(dict(tp=4), "tp <= 2"), (dict(pp=2, microbatches=4), "one granule"),
                      (dict(cp=2), r"deterministic=dict\(cp_chunks=2\)"),
                      (dict(precision="fp16"), "fp16"), (dict(dp=3), "power of two"),
                      (dict(microbatches=3), "power of two"), (dict(dp=4, microbatches=8), "does not divide")]:
        kw = {"dp": 1, **kw}
        with pytest.raises(ValueError, match=match):
            check_layout(det, CFG, **kw)
    with pytest.raises(ValueError, match=r"deterministic=dict\(tp_blocks=4\)"):   # tp > tp_blocks names the option
        check_layout(det, CFG, dp=1, tp=4)
    llama = lesson.gpt_config(64, model="llama", block_size=T, n_layer=2, n_head=2, n_embd=16)   # 1 kv head
    with pytest.raises(ValueError, match=r"\{'n_kv_head': 1\} are not divisible by tp_blocks = 2"):
        check_layout(det, llama, dp=1, tp=2)
    check_layout(Deterministic.of(dict(tp_blocks=4)), lesson.gpt_config(64, block_size=T, n_head=4), dp=1, tp=4)
    with pytest.raises(ValueError, match=r"\{.n_head.: 2\} are not divisible by tp_blocks = 4"):   # 2 heads
        check_layout(Deterministic.of(dict(tp_blocks=4)), CFG, dp=1, tp=2)
    cp2 = Deterministic.of(dict(cp_chunks=2))
    for kw, match in [(dict(context_parallel="ring"), "ring attention"), (dict(context_parallel="ring-zigzag"),
                      "ulysses"), (dict(tp=2), "tp > 1"), (dict(pp=2, microbatches=16), "pipeline")]:
        with pytest.raises(ValueError, match=match):    # cp 2 accepts Ulysses alone, without tp or pp
            check_layout(cp2, CFG, **{"dp": 1, "cp": 2, "context_parallel": "ulysses", **kw})
    with pytest.raises(ValueError, match="RoPE"):
        check_layout(cp2, lesson.gpt_config(64, model="llama", block_size=T, n_head=2, n_embd=16), dp=1, cp=2)
    with pytest.raises(ValueError, match="needs cp_chunks = 1"):        # the chunk tree needs cp = cp_chunks
        check_layout(cp2, CFG, dp=2)
    check_layout(cp2, CFG, dp=2, cp=2, context_parallel="ulysses")
    for bad, match in ((dict(tp_blocks=3), "tp_blocks must be a power of two"), (dict(blocks=4), "unknown")):
        with pytest.raises(ValueError, match=match):
            Deterministic.of(bad)
    with pytest.raises(ValueError, match="power of two"):
        Deterministic(12)
    with pytest.raises(ValueError, match="divisible by 16"):
        run_local(1, True, B=24, steps=1)
    with pytest.raises(ValueError, match="not 'fp16'"):         # built by hand, past parallelize's check
        MixedPrecision(Local(precision.cast_module(GPT(CFG, SEED), "fp16"), deterministic=True), "fp16")


def test_layouts_same_bits_under_mpiexec():
    """One launch of 4 ranks: every dp / ZeRO / pp / dp x pp / tp 2 (+SP) case equal to one
    process after the issue's 20 AdamW steps, float32 and bf16: every dp / ZeRO / pp / dp x pp /
    tp 2 (+SP) case, and a MoE GPT at dp 2 x ep 2 (ZeRO 0 and 3) and dp 4 x ep 2 with ZeRO-1;
    beyond the issue's grid, with tp_blocks = 4, tp 2 and tp 4 (+SP) and Llama at tp 2 and tp 4
    (those in 2 steps: a step's bits are a function of the state's bits and the batch, so
    equality at every step is an induction); Ulysses cp 2 and dp 2 x cp 2 (ZeRO-2 too) against
    one process with cp_chunks = 2 (20 steps); the default mode's controls
    (dense dp 4 m 2, MoE dp 4 x ep 2) not equal."""
    out = mpirun(4, "tests/workers/deterministic.py", "--steps", "20", timeout=400)
    rows = reports(out)
    cases = {r["case"] for r in rows}
    precs = ("fp32", "bf16")
    want = {f"{p}.dp{n}.{c}" for p in precs for n in (2, 4) for c in ("m1", "m2", "m4", "zero1", "zero2", "zero3")}
    want |= {f"{p}.pp2.{s}" for p in precs for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")}
    want |= {f"{p}.dp2xpp2.{c}" for p in precs for c in ("1f1b", "zero1.interleaved")}
    want |= {f"{p}.tp2{sp}" for p in precs for sp in ("", ".sp")}
    want |= {f"{p}.{c}" for p in precs for c in ("ep2", "ep2.zero3", "dp4xep2.zero1")}   # a MoE GPT, ep 2
    want |= {"fp32.tp2.b4.sp", "bf16.tp2.b4", "fp32.llama.tp2.sp", "bf16.llama.tp2"}       # tp_blocks 4; Llama
    want |= {"fp32.tp4", "fp32.tp4.sp", "bf16.tp4.sp", "fp32.llama.tp4", "bf16.llama.tp4.sp"}
    want |= {f"{p}.{c}" for p in precs for c in ("cp2", "dp2xcp2")} | {"fp32.dp2xcp2.zero2"}   # Ulysses cp 2
    assert want <= cases, sorted(want - cases)
    bad = [r for r in rows if r["case"] in want and not r["equal"]]
    assert not bad, bad
    drops = [r["dropped"] for r in rows if r["case"].endswith(".ep2")]
    assert len(drops) == 4 and min(drops) > 0, drops          # the capacity (per granule) dropped rows
    for name in ("control.default.dp4.m2", "control.default.dp4xep2"):
        ctrl = [r for r in rows if r["case"] == name]
        assert len(ctrl) == 4 and not any(r["equal"] for r in ctrl), ctrl


# the 8-rank test's job, in the suite's 8-rank launch (tests/shared_launch.py)
SUITE_JOBS = {"test_dp_tp_pp_same_bits_under_mpiexec": (8, ["tests/workers/deterministic.py", "--steps", "20"])}


def test_dp_tp_pp_same_bits_under_mpiexec(request):
    """At 8 ranks: dp 2 x tp 2 x pp 2 (1f1b), float32, and bf16 with sequence
    parallelism, equal to one process bit for bit after 20 steps."""
    rows = own(request, world(8, request))
    assert {r["case"] for r in rows} == {"fp32.dp2xtp2xpp2", "bf16.dp2xtp2xpp2.sp"} and len(rows) == 16, rows
    bad = [r for r in rows if not r["equal"]]
    assert not bad, bad
