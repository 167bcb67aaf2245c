"""The engine: arrays, autograd and the ops every model is made of.

    backend.py       xp = NumPy or CuPy (PDIST_DEVICE), to_numpy, dtype facts
    env.py           PDIST_* environment variables, read by name and checked
    autograd.py      Tensor, Function, hooks, no_grad
    backprop.py      the backward walk: reverse topological order, gradient sums, leaves
    ops.py           the operators of Tensor (arithmetic, matmul, reductions), hand-derived backwards
    shape_ops.py     reshape, permute, indexing, concat, split
    functional.py    fused Linear (both weight layouts), Embedding, causal softmax, cross-entropy
    norms.py         LayerNorm, RMSNorm
    activations.py   GELU, SwiGLU
    rope.py          rotary position embeddings (HF Llama's convention)
    reductions.py    row and column sums as BLAS products
    attention.py     causal self-attention, multi-head or grouped-query, in causal blocks
    precision.py     bf16/fp16 casts, mixed-precision matmul and gradient accumulation
    grad_scaler.py   fp16's dynamic loss scaling
    recompute.py     activation recomputation: checkpoint(fn, *inputs)
    hooks.py         step hooks: where the instruments (pdist/measure, pdist/faults) attach to the step
    meta.py          shape-only parameters, filled piece by piece
    index_checks.py  token-id bounds, one host read per step on a GPU
    gradcheck.py     finite differences against backward
"""
