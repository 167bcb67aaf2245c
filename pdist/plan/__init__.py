"""The planner for real clusters (docs/planning.md): memory per GPU and time per step.

    planner.py   plan(), search(), the table and charts, ``python -m pdist.plan``
    model.py     the formulas (ZeRO's memory, Korthikanti's activations, α–β collectives)
    presets.py   models and clusters by name

This package never imports MPI.
"""
from pdist.plan.planner import main, plan, png_chart, search, table, text_chart

__all__ = ["plan", "search", "table", "text_chart", "png_chart", "main"]
