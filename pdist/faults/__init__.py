"""The ways training breaks, shown and handled (docs/failures.md).

    debug.py    the straggler detector: per-step clocks of every rank, straggler_report
    diverge.py  where two fingerprinted runs part: the first step, op, tensor, rank (docs/divergence.md)
    inject.py   teaching faults (--inject): stragglers, slow links, exceptions, skipped syncs
"""
