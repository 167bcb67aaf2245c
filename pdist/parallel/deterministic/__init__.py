"""The deterministic mode: the same bits on every layout, a layer applied from outside.

    model = parallelize(GPT(cfg, seed), mesh, zero_stage=2, deterministic=True)
    one = Local(GPT(cfg, seed), deterministic=True)       # one process: the same bits

The contract and the math are policy.py's (docs/deterministic.md). No strategy names the
mode: it registers, for each strategy class it changes, a mixin (pdist/parallel/modes.py),
and a chain built around ``Local(..., deterministic=...)`` takes them:

    Local                 GranuleCompute         compute.py   granule leaves, a fixed tree; the root written once
    DataParallelNaive     NaiveTreeJoin          strategies.py  the trees joined by recursive doubling (join.py)
    DataParallel          BucketTreeJoin         strategies.py  the same, into the bucket views
    ZeRO                  ShardTreeJoin          strategies.py  the same, then each rank keeps its shard
    TensorParallel        BlockedTensorParallel  tensor.py    the layers' sums in tp_blocks fixed blocks (blocks.py)
    PipelineParallel      TreePipeline           pipeline.py  one granule per micro-batch, a tree per stage
    ExpertParallel        ExpertTreeJoin         experts.py   each expert run per source granule, its own tree
    MixedPrecision        Bf16Only               strategies.py  bf16 (fp16's dynamic loss scale is refused)
    ContextParallel       InMode                 context.py   Ulysses: (token chunk, granule) leaves

Its kernels (kernels.py: BLAS on one thread, the exact scatter, the batched pass's per-granule
GEMMs and sums, granules.py) swap in for the engine's ops while the mode computes
(``autograd.substitute``).
"""
from pdist.parallel import modes
from pdist.parallel.base import Local
from pdist.parallel.context.context_parallel import ContextParallel
from pdist.parallel.data_parallel import DataParallel, DataParallelNaive
from pdist.parallel.deterministic.checks import check_layout
from pdist.parallel.deterministic.compute import GranuleCompute
from pdist.parallel.deterministic.experts import ExpertTreeJoin
from pdist.parallel.deterministic.join import TreeSums, join, join_root, tree_all_reduce
from pdist.parallel.deterministic.kernels import exact_kernels
from pdist.parallel.deterministic.pipeline import TreePipeline
from pdist.parallel.deterministic.policy import DEFAULT_GRANULES, TP_BLOCKS, Deterministic, GranuleTree, InMode
from pdist.parallel.deterministic.strategies import BucketTreeJoin, Bf16Only, NaiveTreeJoin, ShardTreeJoin
from pdist.parallel.deterministic.tensor import BlockedTensorParallel
from pdist.parallel.expert_parallel import ExpertParallel
from pdist.parallel.mixed_precision import MixedPrecision
from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel
from pdist.parallel.tensor.tensor_parallel import TensorParallel
from pdist.parallel.zero.zero import ZeRO


modes.register("deterministic", {
    Local: GranuleCompute, DataParallelNaive: NaiveTreeJoin, DataParallel: BucketTreeJoin, ZeRO: ShardTreeJoin,
    TensorParallel: BlockedTensorParallel, PipelineParallel: TreePipeline, ExpertParallel: ExpertTreeJoin,
    MixedPrecision: Bf16Only, ContextParallel: InMode})

__all__ = ["Deterministic", "GranuleTree", "DEFAULT_GRANULES", "TP_BLOCKS", "check_layout", "exact_kernels",
           "TreeSums", "join", "join_root", "tree_all_reduce"]
