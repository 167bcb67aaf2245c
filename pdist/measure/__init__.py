"""What a run measures about itself.

    trace.py              per-rank events merged into one Chrome/Perfetto trace
    memory.py             bytes of params, grads and optimizer state; RSS and its peak
    memory_timeline.py    the memory of every rank over a step, marked by collectives
    activation_memory.py  activation bytes per layer: the formula and the measurement
    fingerprint.py        per-step, per-op fingerprints of activations and gradients (docs/divergence.md)
    waterfall.py          each step's wall time as parts that add up to it (waterfall_table.py prints it)
    blocked.py            host time blocked in communication (the waterfall's and the detector's record)
    flops.py              model FLOPs under named conventions (6N, 6N+12LhT, causal), the GEMM rate
"""
