"""``python -m pdist.train``: one command for a real run, any model, any layout (docs/train.md).

    python -m pdist.train                                        # a small GPT-2 on the bundled corpus
    mpirun -n 4 python -m pdist.train --dp 2 --tp 2 --steps 50   # saves into runs/train/ckpt
    mpirun -n 4 python -m pdist.train --dp 4 --steps 100 --resume   # continues under another layout

    flags.py     the flags, the config file (.toml/.json), every check made before MPI starts
    corpus.py    a text file or a token file (.npy/.bin), the held-out split, the batches
    build.py     config, layout checks, parallelize, AdamW, the learning-rate schedule
    progress.py  the progress bar, log.jsonl, MFU
    plot.py      --plot: loss.png (and the waterfall when pdist.measure.waterfall is there)
    run.py       main(argv): the run, saves, --resume, eval, Ctrl-C
"""


def main(argv=None):
    """Run ``python -m pdist.train`` with ``argv`` (default: sys.argv[1:]); returns the exit status."""
    from pdist.train.run import main as run_main
    return run_main(argv)


__all__ = ["main"]
