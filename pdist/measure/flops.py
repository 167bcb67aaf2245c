"""Model FLOPs under named conventions, and the device's measured GEMM rate: MFU's two halves.

Training FLOPs per token of a decoder with N matmul parameters, L layers, width h, context T
(a multiply-add is 2 FLOPs; backward costs twice forward, so training is 3x forward):

    "6N"          6 N                    Kaplan et al. 2020 (Scaling Laws, Sec. 2.1): the
                                         weights' matmuls only, attention's T x T products ignored
    "6N+12LhT"    6 N + 12 L h T         PaLM (Chowdhery et al. 2022, App. B), the paper that
                                         defined MFU; Megatron-LM's count (Narayanan et al. 2021,
                                         Eq. 3 without its recompute pass: 72 B s l h^2 (1 + s/6h
                                         + ...), whose attention term is 12 B s^2 l h): QK^T and AV,
                                         2 x 2 L h T forward per token, x 3
    "causal"      6 N + 6 L h T          the causal mask halves the attention products, as a
                                         kernel that skips masked blocks counts them

The default is "6N+12LhT": MFU is PaLM's definition and Megatron-LM's count, so published
MFU figures compare with it. It counts the model's FLOPs, not a kernel's: pdist's attention
(pdist/engine/attention.py) skips the masked query blocks and computes (n + 1) / 2n of the
T x T scores (n = ceil(T / 64) blocks on the host), so the work it does lies between
"causal" and "6N+12LhT" (all of it at T <= 64). "6N" leaves attention out (a fraction
2 L h T / N of 6N: large at long context). Recomputation adds hardware FLOPs, not model
FLOPs: MFU leaves it out (HFU would count it).

N: every parameter that multiplies an activation: all of ``cfg.param_shapes()`` but the
position table (``wpe``) and an input embedding not tied to the output head (Llama's
``embed_tokens``), which are looked up, not multiplied. A mixture of experts counts each
token's top-k experts, not all of them.

The rate: ``gemm_rate()`` times an n x n x n matmul (n = 256; PDIST_GEMM_N) in the compute
dtype on the active backend, the best of a few after a warm-up, once per process (cached).
``PDIST_PEAK_FLOPS`` overrides it (a datasheet peak, to compare with published MFU).
"""
import time

from pdist.engine.backend import default_dtype, synchronize, xp
from pdist.engine.env import env_number

CONVENTIONS = ("6N", "6N+12LhT", "causal")
DEFAULT = "6N+12LhT"
_rate = {}


def matmul_params(cfg):
    """N of the module doc: the parameters of ``cfg`` that multiply activations."""
    n = 0
    tied = not hasattr(cfg, "n_kv_head")          # GPT ties wte to the head; Llama does not
    experts, top_k = getattr(cfg, "n_expert", 0) or 0, getattr(cfg, "expert_top_k", 1) or 1
    for name, shape in cfg.param_shapes().items():
        size = 1
        for d in shape:
            size *= d
        if name.endswith("wpe.weight") or (name.endswith("embed_tokens.weight") and not tied):
            continue
        if experts and ".experts." in name:
            size = size * top_k / experts       # each token passes through top_k of the experts
        n += size
    return n


def per_token(cfg, convention=DEFAULT, seq_len=None):
    """Training FLOPs per token of ``cfg`` under ``convention`` (module doc); ``seq_len``:
    the context T (default ``cfg.block_size``)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"FLOP convention must be one of {CONVENTIONS}, got {convention!r}")
    n = 6.0 * matmul_params(cfg)
    lht = cfg.n_layer * cfg.n_embd * (seq_len or cfg.block_size)
    return n + {"6N": 0.0, "6N+12LhT": 12.0 * lht, "causal": 6.0 * lht}[convention]


def gemm_rate(dtype=None):
    """FLOP/s of this process's GEMM in ``dtype`` (default: the compute dtype), measured once
    and cached (module doc); ``PDIST_PEAK_FLOPS`` overrides the measurement."""
    peak = env_number("PDIST_PEAK_FLOPS", 0.0, "FLOP/s (e.g. 1e12)", 0.0, zero_ok=True)
    if peak:
        return float(peak)
    dtype = dtype or default_dtype()
    key = str(dtype)
    if key not in _rate:
        n = int(env_number("PDIST_GEMM_N", 256, "matrix size", 256, integer=True))
        a = xp.ones((n, n), dtype=dtype)
        b, out = a * 0.5, xp.empty((n, n), dtype=dtype)
        best = float("inf")
        for i in range(6):                         # the first is a warm-up
            synchronize()
            t0 = time.perf_counter()
            xp.matmul(a, b, out=out)
            synchronize()
            if i:
                best = min(best, time.perf_counter() - t0)
        _rate[key] = 2.0 * n ** 3 / max(best, 1e-9)
    return _rate[key]


__all__ = ["CONVENTIONS", "DEFAULT", "matmul_params", "per_token", "gemm_rate"]
