"""Tensor and sequence parallelism (Megatron-LM; Korthikanti et al. 2022).

    tensor_parallel.py  TensorParallel: the model's layers swapped for the parallel ones
    layers.py           ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, the loss
    regions.py          Megatron's conjugate f/g regions and the partitioning helpers
"""
