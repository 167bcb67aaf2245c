"""tests/test_train.py's runs of ``python -m pdist.train`` in one 4-rank launch (main(argv) three times):

    A: dp 2 x tp 2, steps 0-2, saves at 2              (data: a .npy token file)
    B: --resume at dp 4 from A's step 2 to step 4      (flags from a config file; data: the same ids as .bin)
    C: dp 4, steps 0-4 uninterrupted, saves at 2 and 4
    D: --resume of A's run with another model (--n-embd 32): refused with a message, exit status 2

Each rank reports main's exit status; the test compares the checkpoints."""
import os
import sys

from pdist import comm
from pdist.testing import report
from pdist.train import main

root = sys.argv[1]
common = ["--steps", "2", "--batch-size", "8", "--n-layer", "2", "--n-head", "2", "--n-embd", "16",
          "--block-size", "8", "--dtype", "float64", "--lr-schedule", "constant", "--warmup", "0",
          "--eval-every", "2", "--log-every", "1"]
codes = {}
codes["A"] = main(common + ["--data", os.path.join(root, "ids.npy"), "--dp", "2", "--tp", "2",
                            "--out", os.path.join(root, "A"), "--save-every", "2"])
codes["B"] = main(["--config", os.path.join(root, "b.toml"), "--steps", "4", "--out", os.path.join(root, "A"),
                   "--resume"])
codes["C"] = main(common[2:] + ["--steps", "4", "--data", os.path.join(root, "ids.npy"), "--dp", "4",
                                "--out", os.path.join(root, "C"), "--save-every", "2"])
codes["D"] = main(common + ["--data", os.path.join(root, "ids.npy"), "--n-embd", "32", "--out",
                            os.path.join(root, "A"), "--resume"])           # another model: refused (2)
report(rank=comm.get_world().rank, codes=codes)
