"""Trace: every rank's events merged into one Chrome/Perfetto JSON."""
import json
from pathlib import Path

import pytest

from shared_launch import own, scratch, world

W = Path(__file__).parent / "workers"


def test_local_recorder():
    from pdist.measure import trace
    trace.clear()
    with trace.span("x", cat="compute", k=1):
        pass
    trace.record("y", "comm", 1.0, 2.5, op="send")
    ev = trace.events()
    assert [e["name"] for e in ev] == ["x", "y"] and ev[1]["end"] - ev[1]["start"] == 1.5
    assert ev[0]["args"] == {"k": 1}
    assert trace.comm_seconds() == 1.5
    trace.disable()
    trace.record("z", "comm", 0, 1)
    trace.enable()
    assert len(trace.events()) == 2
    trace.clear()
    assert trace.events() == []


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {f"test_chrome_trace_merges_ranks[{n}]": (n, [W / "comm_trace.py", scratch(f"trace-n{n}.json")])
              for n in (1, 4)}


@pytest.mark.parametrize("n", [1, 4])
def test_chrome_trace_merges_ranks(n, request):
    path = Path(scratch(f"trace-n{n}.json"))
    got = own(request, world(n, request))
    doc = json.loads(path.read_text())
    ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(r["rank"] for r in got) == list(range(n)) and all(r["n"] == n for r in got), got
    counts = {r["rank"]: r["events"] for r in got}   # rank 0 writes the merged file and counts it
    assert counts[0] in (len(ev), len(doc["traceEvents"])) and all(counts[r] is None for r in range(1, n)), counts
    assert {e["pid"] for e in ev} == set(range(n))
    for r in range(n):
        mine = [e for e in ev if e["pid"] == r]
        names = [e["name"] for e in mine]
        assert names[:3] == ["compute", "all_reduce", "all_gather"]
        ar = mine[1]
        assert ar["args"]["bytes"] == 8000 and ar["args"]["group"] == "world" and ar["cat"] == "comm"
        assert mine[0]["dur"] >= 2000 * (r + 1) * 0.9               # slept 2 ms * (rank+1)
    assert min(e["ts"] for e in ev) >= 0
    # aligned clocks: the ring all-reduce ends within a few ms on every rank
    ends = [e["ts"] + e["dur"] for e in ev if e["name"] == "all_reduce"]
    assert max(ends) - min(ends) < 50_000
    if n > 1:
        assert {"send", "recv"} <= {e["name"] for e in ev}
