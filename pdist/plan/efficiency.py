"""How fast a GEMM runs: a roofline per matmul shape times a software profile.

A matmul of M×K by K×N does 2MNK FLOPs and moves at least k·(MK + KN + MN) bytes. Its time is

    t = max(2MNK / (peak · e(M, N, K)),  k·(MK + KN + MN) / memory bandwidth)      (the roofline)
    e(M, N, K) = e_max · g(M) · g(N) · g(K),   g(d) = d / (d + d_half)

e_max is what the library reaches on a large square GEMM, d_half the dimension at which a
GEMM reaches half of it in that dimension (tile quantization and wave effects flatten out
above a few hundred: NVIDIA's "Matrix Multiplication Background" guide shows the curve).
The cluster's ``profile`` (e_max, d_half) is that software profile; the GPU presets use
(0.72, 192), set once from Narayanan et al. 2021 Table 1 (their best runs, A100 + Megatron-LM,
which therefore is not an independent check: docs/planning.md says which cases are). A flat
``efficiency`` (the cluster's, or ``--efficiency``) replaces e(M, N, K) for every shape.
Causal attention under context parallelism computes (cp+1)/(2cp) of the s × s scores (whole
blocks on and below the diagonal); `attention="flash"` half. Under ``fp8`` the linear layers run at
the FP8 peak, the attention scores and the output head at bf16's (``_HIGH``: what Transformer
Engine's and torchtitan's Float8 recipes convert, and what DeepSeek-V3's report, §3.3.1, keeps).
Everything else a layer runs (norms, activations, softmax, residuals) is memory-bound: its bytes
are counted as 16 reads/writes of sbh elements per layer forward, 32 backward, over the
memory bandwidth.
"""

_HIGH = {"fp8": "mixed"}  # the precision attention and the output head run at (FP8 recipes keep them in bf16)
ELEMENTWISE = 16          # sbh elements read + written per layer forward outside the GEMMs (backward 2x)


def gemm_efficiency(M, N, K, profile):
    e_max, d_half = profile
    g = 1.0
    for d in (M, N, K):
        g *= d / (d + d_half)
    return e_max * g


def gemm_time(M, N, K, cluster, precision, flat=None, itemsize=2):
    """Seconds of one M×K @ K×N matmul on one GPU (roofline, profile or ``flat`` efficiency)."""
    peak = cluster.peak[precision]
    e = flat if flat else gemm_efficiency(M, N, K, cluster.profile)
    return max(2 * M * N * K / (peak * e), itemsize * (M * K + K * N + M * N) / cluster.mem_bw)


def layer_time(a, lay, tokens, cluster, flat=None, moe_layer=False):
    """(GEMM seconds, attention-score seconds, elementwise seconds) of one layer's forward on one
    GPU for ``tokens`` rows (b·s/cp); backward is twice each."""
    itemsize = 4 if lay.precision in ("fp32",) else 8 if lay.precision == "fp64" else 2
    gemm = 0.0
    for M, N, K, count, routed in a.gemms(tokens, lay.tp):
        if routed and not moe_layer:
            continue
        if routed:                          # E experts over ep ranks hold the rows of ep shards: E/ep GEMMs
            count = count // lay.ep
            M = M * lay.ep
        gemm += count * gemm_time(M, N, K, cluster, lay.precision, flat, itemsize)
    if a.moe and not moe_layer:             # a dense first layer (DeepSeek-V3)
        gemm += sum(gemm_time(tokens, n, k, cluster, lay.precision, flat, itemsize)
                    for n, k in (((2 if a.gated else 1) * a.ffn // lay.tp, a.h), (a.h, a.ffn // lay.tp)))
    s = (lay.seq_len or a.seq)
    b = max(1, tokens * lay.cp // s)
    heads = a.n_head // lay.tp
    sl = s // lay.cp
    # FlashAttention skips the masked blocks; context parallelism (ring or all-gather, load-balanced
    # chunks) skips the key/value blocks wholly in a query chunk's future: cp(cp+1)/2 of cp² blocks run
    causal = 0.5 if lay.attention == "flash" else (lay.cp + 1) / (2 * lay.cp)
    keys = s if lay.cp > 1 else sl
    if a.window and a.window < keys:       # a sliding window: each query scores `window` keys, no causal halving
        causal, keys = 1.0, a.window
    high = _HIGH.get(lay.precision, lay.precision)
    score = causal * b * heads * sum(gemm_time(sl, keys, d, cluster, high, flat, itemsize)
                                     for d in a.score_dims)           # QKᵀ and AV
    elem = ELEMENTWISE * tokens * a.h / (lay.tp if lay.sp else 1) * itemsize / cluster.mem_bw
    return gemm, score, elem


def head_time(a, lay, tokens, cluster, flat=None):
    itemsize = 4 if lay.precision == "fp32" else 8 if lay.precision == "fp64" else 2
    high = _HIGH.get(lay.precision, lay.precision)
    return gemm_time(tokens, a.vocab // lay.tp, a.h, cluster, high, flat, itemsize)
