"""Every strategy, one shape (docs/design.md): DataParallelNaive, DataParallel, ZeRO,
TensorParallel, PipelineParallel, ContextParallel, ExpertParallel, and ``parallelize`` that
composes them on a DeviceMesh."""
from pdist.parallel.base import Local
from pdist.parallel.context import ContextParallel
from pdist.parallel.data_parallel import DataParallel, DataParallelNaive
from pdist.parallel.expert_parallel import ExpertParallel
from pdist.parallel.mixed_precision import MixedPrecision
from pdist.parallel.parallelize import check_layout, parallelize
from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel
from pdist.parallel.tensor.tensor_parallel import TensorParallel
from pdist.parallel.zero import ZeRO

__all__ = ["Local", "DataParallel", "DataParallelNaive", "ZeRO", "TensorParallel", "PipelineParallel",
           "ContextParallel", "ExpertParallel", "parallelize", "check_layout", "MixedPrecision"]
