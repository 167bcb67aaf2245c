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
    measured.py    plan_for(strategy, batch): a running strategy on this machine's measured profile,
                   beside the measured waterfall (measured_table.py renders the two)

This package never imports MPI (plan_for talks to the strategy's groups it is given).
"""
from pdist.plan.cli import main
from pdist.plan.measured import plan_for
from pdist.plan.planner import plan, search
from pdist.plan.report import png_chart, table, text_chart

__all__ = ["plan", "plan_for", "search", "table", "text_chart", "png_chart", "main"]
