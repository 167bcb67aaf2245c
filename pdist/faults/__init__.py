"""The ways training breaks, shown and handled (docs/failures.md).

    debug.py    the straggler detector: per-step clocks of every rank, straggler_report
    inject.py   teaching faults (--inject): stragglers, slow links, exceptions, skipped syncs
"""
