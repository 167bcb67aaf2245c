"""Context parallelism: each sequence cut over the cp ranks, attention across them (ring
attention, Liu et al. 2023; DeepSpeed-Ulysses, Jacobs et al. 2023; docs/context_parallel.md).

    context_parallel.py  ContextParallel: this rank's rows and tokens; install, check_context
    ring_attention.py    K/V chunks round the ring, merged by the online softmax; ring_bytes
    zigzag.py            which tokens a rank holds (contiguous or zigzag chunks), the causal work
    ulysses.py           all-to-all from tokens to heads and back; ulysses_bytes

The function ``ring_attention`` is ``pdist.parallel.context.ring_attention.ring_attention``:
here the name is its module.
"""
from pdist.parallel.context import ring_attention
from pdist.parallel.context.context_parallel import (MODES, ContextAttention, ContextParallel, ContextPositions,
                                                     check_context, install, token_permutation)
from pdist.parallel.context.ring_attention import RingAttention, ring_bytes
from pdist.parallel.context.ulysses import SeqToHeads, check_heads, ulysses_attention, ulysses_bytes
from pdist.parallel.context.zigzag import LAYOUTS, attention_work, block_pairs, positions, segments

__all__ = ["ContextParallel", "ContextAttention", "ContextPositions", "install", "check_context", "MODES",
           "token_permutation", "ring_attention", "RingAttention", "ring_bytes", "ulysses_attention",
           "SeqToHeads", "check_heads", "ulysses_bytes", "segments", "positions", "block_pairs",
           "attention_work", "LAYOUTS"]
