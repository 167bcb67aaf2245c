"""Pipeline parallelism (GPipe; 1F1B and interleaved, Narayanan et al. 2021).

    pipeline_parallel.py  PipelineParallel: this stage's layers, the executor
    schedules.py          schedules as data; the order a rank posts its messages in
    simulate.py           schedules run on paper: timeline, checker, bubble
    draw.py               ASCII and PNG timelines
"""
