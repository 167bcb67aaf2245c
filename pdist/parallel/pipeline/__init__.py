"""Pipeline parallelism (GPipe; 1F1B and interleaved, Narayanan et al. 2021).

    pipeline_parallel.py  PipelineParallel: the executor of this rank's program
    stages.py             the model cut into stages as its plan says, the tied copies
    schedules.py          schedules as data; the order a rank posts its messages in
    simulate.py           schedules run on paper: timeline, checker, bubble
    draw.py               ASCII and PNG timelines
"""
