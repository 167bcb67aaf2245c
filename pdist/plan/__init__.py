"""The planner for real clusters (docs/planning.md): memory per GPU and time per step, as the
waterfall's parts, of dense and mixture-of-experts models on any layout.

    arch.py        models: parameters by role, total and active, FLOPs and GEMMs per token
    layout.py      the layout, its checks (pdist's refusals), the schedules' stash and bubble
    memory.py      model states (ZeRO), activations (Korthikanti), what frameworks add
    comm.py        bytes per group (dp, tp, pp, cp, ep) and α–β over the links they cross
    efficiency.py  a roofline per GEMM shape with a software-profile efficiency curve
    timing.py      the waterfall's parts, with overlap per group
    model.py       one layout's plan;  planner.py  plan(), search()
    report.py      the header, table and charts;  cli.py  ``python -m pdist.plan``
    presets.py     models and clusters;  published.py, cases.json  the published runs it is held to

This package never imports MPI.
"""
from pdist.plan.cli import main
from pdist.plan.planner import plan, search
from pdist.plan.report import png_chart, table, text_chart

__all__ = ["plan", "search", "table", "text_chart", "png_chart", "main"]
