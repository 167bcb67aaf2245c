"""One failure scenario per run (docs/failures.md): ``python fail_cases.py NAME``.

Each ends the job with an error on every rank that waits (the tests assert on
each rank's tagged report), except the 'ok' scenarios, which report() results.
Rank 1 (or the last rank) is the one that misbehaves."""
import gc
import os
import signal
import sys
import time
import weakref

import numpy as np

from pdist import comm
from pdist.testing import report


def ar(g, value=1.0, size=4):
    x = np.full(size, float(value))
    g.all_reduce(x)
    return x


def fault():
    """Stamp the moment of the fault (bench/failures.py measures detection from it)."""
    report(rank=comm.get_world().rank, fault_at=time.time())


def main(case):
    t = os.environ.get("FAIL_INIT_TIMEOUT")          # a lesson's own default deadline
    g = comm.init(timeout=float(t) if t else None)
    r, n = g.rank, g.size
    for _ in range(3):                       # all_reduce #1..#3 everywhere
        ar(g)
    if case == "clean":
        report(rank=r, ok=True)
    elif case == "exception":
        if r == 1:
            fault()
            raise RuntimeError("deliberate failure on rank 1")
        ar(g)
    elif case == "exit0":
        if r == 1:
            fault()
            sys.exit(0)
        ar(g)
    elif case == "early_exit":               # rank 1's script simply ends
        if r == 1:
            fault()
        else:
            ar(g)
    elif case == "extra":                    # rank 0 calls one collective too many
        if r == 0:
            fault()
            ar(g)
    elif case == "sigint":
        if r == 1:
            fault()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        ar(g)
    elif case == "sigkill":
        if r == 1:
            fault()
            os.kill(os.getpid(), signal.SIGKILL)
        ar(g)
    elif case == "timeout":                  # rank 1 is stuck outside any collective
        if r == 1:
            fault()
            time.sleep(60)
        ar(g)
    elif case == "async_skip":               # only rank 1 issues the async op
        if r == 1:
            fault()
            g.all_reduce(np.ones(8), async_op=True)
        g.barrier()
    elif case == "async_unwaited":           # everyone issues it, rank 1 drops the handle
        w = g.all_reduce(np.ones(8), async_op=True)
        if r == 1:
            fault()
            del w
            gc.collect()
        else:
            w.wait()
        g.barrier()
    elif case == "async_unwaited_exit":      # rank 1 keeps its handle but never waits
        w = g.all_reduce(np.ones(8), async_op=True)
        if r != 1:
            w.wait()
        else:
            fault()
    elif case == "async_after_mismatch":     # caught mismatch, then the group still works
        caught = None
        try:
            if r == 0:
                g.all_reduce(np.ones(8), async_op=True).wait()
            else:
                g.all_reduce(np.ones(8))
        except comm.CollectiveMismatchError as e:
            caught = str(e).splitlines()[0]
        x = np.full(8, r + 1.0)
        g.all_reduce(x, async_op=True).wait()
        y = np.full(3, float(r))
        g.broadcast(y, src=n - 1)
        report(rank=r, caught=caught, sum=float(x[0]), bcast=float(y[0]))
    elif case == "temp_buffer":              # async op on a temporary array, then gc
        w = g.all_reduce(np.ones(1000) * r, async_op=True)
        ref = weakref.ref(w._keep[0])
        gc.collect()
        junk = [np.full(1000, -1.0) for _ in range(200)]
        held = ref()                         # survived gc while in flight
        w.wait()
        del junk
        report(rank=r, alive=held is not None, value=float(held[0]), expect=float(sum(range(n))))
    elif case == "object_mismatch":
        if r == 1:
            fault()
        g.broadcast_object({"rank": r}, src=0 if r != 1 else 1)
    elif case == "subgroup":                 # a mismatch inside the tp group of ranks 0 and 1
        mesh = comm.DeviceMesh(dp=n // 2, tp=2)
        t = mesh.tp_group
        if r == 1:
            fault()
        t.all_reduce(np.ones(10 if r == 1 else 8))
        g.barrier()
    elif case == "skipped_step":
        for step in range(6):
            comm.set_step(step)
            if r == 1 and step == 3:
                fault()
                continue                     # rank 1 skips step 3
            ar(g)
    elif case == "dtype_alias":              # int64 on rank 0, longlong elsewhere: the same dtype
        x = np.full(4, r + 1, np.int64 if r == 0 else np.longlong)
        g.all_reduce(x)
        report(rank=r, sum=int(x[0]))
    elif case == "threads":                  # the user's OPENBLAS_NUM_THREADS stands
        from threadpoolctl import threadpool_info
        report(rank=r, blas=[p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"])
    else:
        raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    main(sys.argv[1])
