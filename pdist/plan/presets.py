"""Presets for the planner (pdist.plan): models, clusters, bytes per element, and the
published numbers the planner is checked against.

Models are pdist configs or Arch (pdist/plan/arch.py): GPTConfigs (lm_head tied to wte) for
GPT-2 124M/350M/774M/1.5B (Radford et al. 2019: V 50257, s 1024), GPT-3 175B (Brown
et al. 2020: 96 layers, h 12288, 96 heads, s 2048) and the 1T model of Narayanan et
al. 2021, Table 1 (128 layers, h 25600, 160 heads, V 51200, s 2048); LlamaConfigs (GQA,
SwiGLU, untied) for Llama 2/3 and Mixtral; an Arch for DeepSeek-V3 (shared experts, dense
first layers). Clusters: GPUs per node, memory, peak per precision, HBM bandwidth, the two
links (α, β), the GEMM profile and the memory reserve.

Bytes per element (the ZeRO paper's K; Rajbhandari et al. 2020, §3.1):

    precision   params  grads  optimizer (Adam)            activations
    fp32        4       4      8  (m, v)                   4
    fp64        8       8      16 (m, v)                   8
    mixed       2       2      12 (fp32 master, m, v)      2   -> 2 + 2 + 12 = 16 bytes/param
    fp8         2       2      12                          2   (FP8 matmuls: the peak, not the bytes)

pdist trains in one dtype, so its runs are planned as fp32 or fp64 (docs/zero.md).
"""
from dataclasses import dataclass, field

from pdist.models.gpt import GPTConfig
from pdist.models.llama import LlamaConfig
from pdist.plan.arch import Arch

BYTES = {  # precision -> (params, grads, optimizer, activations) bytes per element
    "fp32": (4, 4, 8, 4),
    "fp64": (8, 8, 16, 8),
    "mixed": (2, 2, 12, 2),
    "fp8": (2, 2, 12, 2),     # FP8 matmuls (DeepSeek-V3, Transformer Engine): bf16 weights kept, fp32 masters
}


def _gpt(V, s, L, a, h):
    # dtype only matters to pdist's own training; the planner uses the precision's bytes
    return GPTConfig(vocab_size=V, block_size=s, n_layer=L, n_head=a, n_embd=h)


def _llama(V, s, L, a, kv, h, f, **kw):
    return LlamaConfig(vocab_size=V, block_size=s, n_layer=L, n_head=a, n_kv_head=kv, n_embd=h,
                       intermediate_size=f, **kw)


MODELS = {
    "gpt2": _gpt(50257, 1024, 12, 12, 768),           # 124 M
    "gpt2-medium": _gpt(50257, 1024, 24, 16, 1024),   # 350 M
    "gpt2-large": _gpt(50257, 1024, 36, 20, 1280),    # 774 M
    "gpt2-xl": _gpt(50257, 1024, 48, 25, 1600),       # 1.5 B
    "gpt3-175b": _gpt(50257, 2048, 96, 96, 12288),    # 175 B
    "megatron-1t": _gpt(51200, 2048, 128, 160, 25600),  # 1.0 T (Narayanan et al. 2021, Table 1)
    # Touvron et al. 2023 (Llama 2), Table 1 and the released configs; Grattafiori et al. 2024
    # (The Llama 3 Herd of Models), Table 3: layers, width, FFN, heads, kv heads, vocabulary
    "llama2-7b": _llama(32000, 4096, 32, 32, 32, 4096, 11008),
    "llama3-8b": _llama(128256, 8192, 32, 32, 8, 4096, 14336),
    "llama3-70b": _llama(128256, 8192, 80, 64, 8, 8192, 28672),
    "llama3-405b": _llama(128256, 8192, 126, 128, 8, 16384, 53248),
    # Jiang et al. 2024 (Mixtral of Experts): 32 layers, h 4096, FFN 14336, 8 experts, top-2
    "mixtral-8x7b": _llama(32000, 4096, 32, 32, 8, 4096, 14336, n_expert=8, expert_top_k=2),
    # DeepSeek-AI 2024 (DeepSeek-V3 Technical Report), §4.2: 61 layers, h 7168, 128 heads, the
    # first 3 dense (FFN 18432), then 1 shared + 256 routed experts of width 2048, top-8, V 129280.
    # MLA (q rank 1536, kv rank 512, nope 128, rope 64, v 128; the released config) counted as such.
    "deepseek-v3": Arch("deepseek-v3", 129280, 4096, 61, 7168, 128, ffn=18432, gated=True, tied=False,
                        learned_pos=False, bias=False, dropout_masks=False, n_expert=256, top_k=8,
                        expert_ffn=2048, n_shared=1, n_dense=3, mla=(1536, 512, 128, 64, 128)),
    # DeepSeek-AI 2024 (DeepSeek-V2), §2 and §3.1.2: 60 layers, h 5120, 128 heads, MLA as V3, the first
    # layer dense (FFN 12288), then 2 shared + 160 routed experts of width 1536, top-6, V 102400
    "deepseek-v2": Arch("deepseek-v2", 102400, 4096, 60, 5120, 128, ffn=12288, gated=True, tied=False,
                        learned_pos=False, bias=False, dropout_masks=False, n_expert=160, top_k=6,
                        expert_ffn=1536, n_shared=2, n_dense=1, mla=(1536, 512, 128, 64, 128)),
    # NVIDIA 2024 (Nemotron-4 340B Technical Report), Table 1: 96 layers, h 18432, 96 heads, 8 kv heads,
    # squared-ReLU MLP of 73728 (two matrices, not gated), RoPE, untied, no biases, V 256000, s 4096
    "nemotron4-340b": Arch("nemotron4-340b", 256000, 4096, 96, 18432, 96, n_kv_head=8, ffn=73728, gated=False,
                           tied=False, learned_pos=False, bias=False, dropout_masks=False),
}


@dataclass
class Link:
    """A link for the α–β model: a collective step costs α, each byte 1/β (β in bytes/s,
    per GPU per direction, the rate busbw measures)."""
    beta: float
    alpha: float


@dataclass
class Cluster:
    name: str
    gpus_per_node: int
    memory: float                 # bytes per GPU
    peak: dict                    # precision -> FLOP/s per GPU
    intra: Link                   # inside a node
    inter: Link                   # between nodes
    efficiency: float = 0.0       # > 0: one flat GEMM efficiency; 0: the shape profile below
    source: str = ""
    mem_bw: float = 2.0e12        # device memory bandwidth, bytes/s (the roofline's slope)
    profile: tuple = (0.72, 192)  # GEMM efficiency e_max·Π g(d), g(d) = d/(d + d_half) (pdist.plan.efficiency)
    reserve: float = 1.5 * 2 ** 30   # bytes the CUDA context, NCCL buffers and the allocator's cache keep
    overhead: float = 0.0         # seconds of framework overhead per step (the waterfall's "overhead")
    op_s: float = 0.0             # host seconds per op forward + backward (pdist.plan.measured.host_op_cost)
    step_s: float = 0.0           # host seconds of the optimizer per tensor it steps (the same calibration)
    nodes: int = 0                # 0: as many as the layout needs
    pcie: float = 25e9            # host <-> GPU bytes/s per GPU each way (PCIe Gen4 x16 as measured, ~25 GB/s)
    baseline: float = 0.0         # bytes a rank's process holds before the model (interpreter, libraries)
    host_bw: float = 25e9         # host memory bytes/s per GPU for an offloaded optimizer (CPU Adam)
    extra: dict = field(default_factory=dict)


GiB = 2 ** 30

# One core-rank of this machine is a "GPU". Numbers measured by pdist's own benches
# (README "Measured"; an Intel Xeon, 2 cores, load average about 1, 2026-11-30):
#  * peak fp32: bench/step_time.py, large GPT (L4 C512 T256 B8, V 96): the BLAS-only floor
#    (every matmul forward and backward, nothing else) 1198.10 ms per step at 1 BLAS thread;
#    peak := model FLOPs of that step / 1198.10 ms. pdist's step took 1427.92 ms, so the
#    efficiency is 1198.10 / 1427.92 = 0.84 (docs/foundation.md).
#  * link: bench/collectives.py, n = 2, pdist "mpi" all-reduce: busbw 5.37 GB/s at 16 MiB
#    and 16.7 µs per call at 8 B (docs/collectives.md).
#  * memory: 23 GiB of RAM for both ranks (as `free` reported), 11.5 GiB each.
#  * baseline: 61 MB, the RSS of a rank of a 4-rank job before its model (Python, NumPy, MPI, pdist
#    imported, comm.init() done; tests/workers/zero_rss.py measures 61.3-61.5 MB, 2026-12-02).
_FLOOR_CFG = GPTConfig(vocab_size=96, block_size=256, n_layer=4, n_head=8, n_embd=512)
_FLOOR_S = 1.19810
_PDIST_S = 1.42792


def model_flops_per_token(cfg, s=None):
    """Model FLOPs per token for forward + backward: 6Ψ (Kaplan et al. 2020) + 12·L·s·h
    for the attention scores and their use (QKᵀ and AV, 2 matmuls of 2·s·h FLOPs per token
    per layer, three passes; Narayanan et al. 2021, Eq. 3)."""
    s = cfg.block_size if s is None else s
    return 6 * cfg.num_params() + 12 * cfg.n_layer * s * cfg.n_embd


_CPU_PEAK = model_flops_per_token(_FLOOR_CFG) * 8 * 256 / _FLOOR_S

CLUSTERS = {
    "a100": Cluster(
        "8 x A100-80GB (NVLink 600 GB/s, 8 x 200 Gb/s InfiniBand)", 8, 80 * GiB,
        {"mixed": 312e12, "fp8": 312e12, "fp32": 19.5e12, "fp64": 19.5e12},
        intra=Link(300e9, 5e-6), inter=Link(25e9, 10e-6), mem_bw=2.0e12,
        source="NVIDIA A100 datasheet: bf16/fp16 dense 312 TFLOP/s, fp32 19.5, fp64 tensor 19.5, HBM 2.0 TB/s; "
               "NVLink 600 GB/s both ways = 300 GB/s each way; 200 Gb/s = 25 GB/s per GPU; "
               "α 5 µs / 10 µs assumed"),
    "a100-eth": Cluster(
        "8 x A100-80GB (NVLink 600 GB/s), nodes joined by one 100 Gb/s Ethernet port", 8, 80 * GiB,
        {"mixed": 312e12, "fp8": 312e12, "fp32": 19.5e12, "fp64": 19.5e12},
        intra=Link(300e9, 5e-6), inter=Link(12.5e9 / 8, 30e-6), mem_bw=2.0e12,
        source="as a100, but 100 Gb/s = 12.5 GB/s per node shared by its 8 GPUs (1.56 GB/s each); "
               "α 30 µs assumed"),
    "a100-40gb": Cluster(
        "8 x A100-40GB (NVLink 600 GB/s, 8 x 200 Gb/s InfiniBand)", 8, 40 * GiB,
        {"mixed": 312e12, "fp8": 312e12, "fp32": 19.5e12, "fp64": 19.5e12},
        intra=Link(300e9, 5e-6), inter=Link(25e9, 10e-6), mem_bw=1.555e12,
        source="NVIDIA A100 datasheet, 40 GB SXM: the 80 GB part's compute and links, HBM2 1.555 TB/s; "
               "α assumed"),
    "v100": Cluster(
        "16 x V100-32GB per DGX-2 node (NVSwitch, 8 x 100 Gb/s InfiniBand per node)", 16, 32 * GiB,
        {"mixed": 125e12, "fp8": 125e12, "fp32": 15.7e12, "fp64": 7.8e12},
        intra=Link(150e9, 5e-6), inter=Link(6.25e9, 10e-6), mem_bw=0.9e12, pcie=12e9,
        source="NVIDIA V100 SXM3 datasheet: fp16 tensor 125 TFLOP/s, fp32 15.7, fp64 7.8, HBM2 900 GB/s; six "
               "NVLink 2 links of 25 GB/s each way (150 GB/s) through NVSwitch; 8 x 100 Gb/s for 16 GPUs = "
               "6.25 GB/s per GPU; PCIe Gen3; α assumed"),
    "h100": Cluster(
        "8 x H100-80GB SXM (NVLink 900 GB/s, 8 x 400 Gb/s InfiniBand)", 8, 80 * GiB,
        {"mixed": 989e12, "fp8": 1979e12, "fp32": 67e12, "fp64": 67e12},
        intra=Link(450e9, 5e-6), inter=Link(50e9, 10e-6), mem_bw=3.35e12, pcie=50e9,
        source="NVIDIA H100 SXM datasheet: bf16 dense 989 TFLOP/s, fp8 1979, fp32 67, fp64 tensor 67, "
               "HBM3 3.35 TB/s; NVLink 900 GB/s both ways = 450 GB/s each way; 400 Gb/s = 50 GB/s per GPU; "
               "α 5 µs / 10 µs assumed"),
    "h800": Cluster(
        "8 x H800-80GB (NVLink 400 GB/s, 8 x 400 Gb/s InfiniBand)", 8, 80 * GiB,
        {"mixed": 989e12, "fp8": 1979e12, "fp32": 67e12, "fp64": 67e12},
        intra=Link(200e9, 5e-6), inter=Link(50e9, 10e-6), mem_bw=3.35e12, pcie=50e9,
        source="as h100 with NVLink 400 GB/s both ways (the DeepSeek-V3 report, §3.1); α assumed"),
    "h200": Cluster(
        "8 x H200-141GB SXM (NVLink 900 GB/s, 8 x 400 Gb/s InfiniBand)", 8, 140 * GiB,
        {"mixed": 989e12, "fp8": 1979e12, "fp32": 67e12, "fp64": 67e12},
        intra=Link(450e9, 5e-6), inter=Link(50e9, 10e-6), mem_bw=4.8e12, pcie=50e9,
        source="NVIDIA H200 SXM datasheet: the H100's compute (bf16 dense 989, fp8 1979), HBM3e 141 GB at "
               "4.8 TB/s; NVLink 900 GB/s both ways; 400 Gb/s per GPU; α assumed"),
    "b200": Cluster(
        "8 x B200-180GB (NVLink 5 1.8 TB/s, 8 x 400 Gb/s InfiniBand)", 8, 179 * GiB,
        {"mixed": 2250e12, "fp8": 4500e12, "fp32": 75e12, "fp64": 37e12},
        intra=Link(900e9, 5e-6), inter=Link(50e9, 10e-6), mem_bw=8.0e12, pcie=50e9,
        source="NVIDIA HGX B200 datasheet per GPU (dense, half the sparse figures): bf16 2.25 PFLOP/s, fp8 4.5, "
               "fp32 75 TFLOP/s, fp64 37; HBM3e 180 GB at 8 TB/s; NVLink 5 1.8 TB/s both ways; "
               "400 Gb/s per GPU; α assumed"),
    "mi300x": Cluster(
        "8 x MI300X-192GB (Infinity Fabric 7 x 64 GB/s, 8 x 400 Gb/s)", 8, 192 * GiB,
        {"mixed": 1307e12, "fp8": 2615e12, "fp32": 163e12, "fp64": 163e12},
        intra=Link(448e9, 5e-6), inter=Link(50e9, 10e-6), mem_bw=5.3e12, pcie=50e9,
        source="AMD Instinct MI300X datasheet: bf16 dense 1307 TFLOP/s, fp8 2615, fp32/fp64 matrix 163, "
               "HBM3 192 GB at 5.3 TB/s; 7 Infinity Fabric links of 64 GB/s each way to the node's other "
               "GPUs (448 GB/s); 400 Gb/s per GPU; α assumed"),
    "this": Cluster(
        "this machine: 2 CPU cores, one rank per core", 2, 23 * GiB / 2,
        {"fp32": _CPU_PEAK, "fp64": _CPU_PEAK / 2, "mixed": _CPU_PEAK},
        intra=Link(5.37e9, 16.7e-6), inter=Link(5.37e9, 16.7e-6), efficiency=_FLOOR_S / _PDIST_S,
        mem_bw=10e9, reserve=0.0, baseline=61e6,
        source="README 'Measured' (Intel Xeon, 2 cores, 2026-11-30): bench/step_time.py large GPT, "
               "BLAS floor 1198.10 ms vs pdist 1427.92 ms -> peak fp32 %.0f GFLOP/s per core, "
               "efficiency 0.84; bench/collectives.py n = 2: busbw 5.37 GB/s (16 MiB), 16.7 µs "
               "(8 B); fp64 peak taken as half (assumed); RAM 23 GiB shared" % (_CPU_PEAK / 1e9)),
}

# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM", arXiv 2104.04473), Table 1: V 51200, s 2048, mixed precision,
# A100-80GB (Selene). Columns: params (B), heads, hidden, layers, t, p, GPUs, batch,
# achieved TFLOP/s per GPU, percent of peak.
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]


def narayanan_flops(B, s, L, h, V):
    """Narayanan et al. 2021, Eq. 3: FLOPs per iteration with full activation recompute,
    F = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) (how Table 1's TFLOP/s are counted)."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
