"""Harness check: rank 1 fails (or, with 'hang', rank 0 waits forever)."""
import sys

import numpy as np

from pdist import comm

g = comm.init()
if sys.argv[1:2] == ["hang"]:            # (a second argument only tags the launch)
    if g.rank == 0:
        g.recv(np.empty(1), 1)          # nobody sends: a hang the harness must kill
    g.barrier()
elif g.rank == 1:
    raise RuntimeError("deliberate failure on rank one")
g.barrier()
