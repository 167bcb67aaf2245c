"""Records comm and compute spans on every rank and writes one Chrome trace."""
import sys
import time

import numpy as np

from pdist import comm
from pdist.measure import trace
from pdist.testing import report


def main():
    path = sys.argv[1]
    g = comm.init()
    trace.clear()
    with trace.span("compute", cat="compute", step=0):
        time.sleep(0.002 * (g.rank + 1))
    g.all_reduce(np.ones(1000), algorithm="ring")              # 8000 bytes
    g.all_gather(np.empty(6 * g.size), np.ones(6), async_op=True).wait()
    if g.size > 1:
        if g.rank == 0:
            g.send(np.ones(10), 1)
        elif g.rank == 1:
            g.recv(np.empty(10), 0)
    trace.disable()
    g.all_reduce(np.ones(3))                                     # not recorded
    trace.enable()
    names = [e["name"] for e in trace.events()]
    assert names[:3] == ["compute", "all_reduce", "all_gather"], names
    e = trace.events()[1]
    assert e["args"] == {"op": "all_reduce", "bytes": 8000, "group": "world", "algorithm": "ring"}, e
    assert e["end"] >= e["start"]
    count = trace.write_chrome_trace(path, g)
    assert (count is not None) == (g.rank == 0)
    report(rank=g.rank, n=g.size, events=count)


if __name__ == "__main__":
    main()
