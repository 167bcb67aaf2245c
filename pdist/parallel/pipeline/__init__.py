"""Pipeline parallelism (GPipe; 1F1B and interleaved, Narayanan et al. 2021; zero bubble,
Qi et al. 2024; DualPipeV, DeepSeek-AI 2024).

    pipeline_parallel.py  PipelineParallel: the executor of this rank's program
    split_backward.py     the executor's B and W (BACKWARD_INPUT, BACKWARD_WEIGHT)
    stats.py              what a step measures (peak stash, timeline): a step hook around its passes
    stages.py             the model cut into stages as its plan says, the tied copies
    instructions.py       the instructions (F, BACKWARD, B, W, messages) and the placements
    schedules.py          schedules as data: gpipe, 1f1b, interleaved; make_schedule
    zero_bubble.py        zb-h1, zb-v, dualpipev: the backward split into B and W
    rendezvous.py         the order a rank posts its messages in (blocking transports)
    simulate.py           schedules run on paper: timeline, checker, bubble
    draw.py               ASCII and PNG timelines
"""
