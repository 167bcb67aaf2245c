"""Pipeline parallelism (GPipe; 1F1B and interleaved, Narayanan et al. 2021).

    pipeline_parallel.py  PipelineParallel: this stage's layers, the executor
    schedules.py          schedules as data, with a checker
    draw.py               ASCII and PNG timelines
"""
