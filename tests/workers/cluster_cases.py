"""Cluster scenarios (tests/test_cluster_mpi.py): ``python cluster_cases.py NAME``.

* ``threads``: report this rank's mask, the node's cores, BLAS threads and the wait mode.
* ``spin``: report "ready", then all_reduce forever (the test signals the launcher).
* ``dead``: rank 1 SIGKILLs itself; the others wait in all_reduce #4 and must name it dead.
* ``dead_sim``: rank 1 sleeps outside any collective; rank 0 is handed an exited pid as
  rank 1's and must name it dead at once (reports the seconds it took).
* ``world``: report the world's size (a job that should never get this far when split)."""
import os
import signal
import sys
import time

import numpy as np

from pdist import comm
from pdist.testing import report


def main(case):
    g = comm.init()
    r = g.rank
    x = np.ones(4)
    for _ in range(3):                       # all_reduce #1..#3 everywhere
        g.all_reduce(x)
    if case == "threads":
        from threadpoolctl import threadpool_info
        from pdist.comm import mpi
        report(rank=r, mask=sorted(os.sched_getaffinity(0)), node_cores=mpi.node_cores(),
               cooperative=mpi.cooperative(), threads=mpi._state["limits_n"],
               blas=[p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"])
    elif case == "spin":
        report(rank=r, ready=True, pid=os.getpid())
        while True:
            g.all_reduce(x)
            time.sleep(0.001)
    elif case == "dead":
        if r == 1:
            report(rank=r, fault_at=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            g.all_reduce(x)
        except comm.CollectiveTimeoutError:
            report(rank=r, detect_s=time.monotonic() - t0)
            raise
    elif case == "dead_sim":                 # rank 1 goes quiet; rank 0 is told its pid is one that exited
        if r == 1:
            time.sleep(30)
        import subprocess
        from pdist.comm import liveness
        gone = subprocess.Popen(["true"])
        gone.wait()
        liveness.set_node_pids({1: gone.pid})
        t0 = time.monotonic()
        try:
            g.all_reduce(x)
        except comm.CollectiveTimeoutError:
            report(rank=r, detect_s=time.monotonic() - t0, probe=os.environ.get("CLUSTER_PROBE"))
            raise
    elif case == "world":
        report(rank=r, size=g.size)
    else:
        raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    main(sys.argv[1])
