"""When it breaks (lesson 08): the straggler detector, fault injection, the simulated
cluster and the one trace."""
import json
import random
from pathlib import Path

import pytest

from pdist.faults import debug, inject
from pdist.measure import trace
from pdist.comm import topology
from pdist.testing import launch, mpirun, reports

ROOT = Path(__file__).resolve().parent.parent
W = ROOT / "tests" / "workers"


# ----------------------------------------------------------- no MPI: the classifier
def fake(n=4, steps=10, slow=None, factor=2.0, uneven=None, link=0.0, seed=0):
    """Records of n ranks: compute 10 ms (+ noise), the others wait for the slowest."""
    rng = random.Random(seed)
    per = [[] for _ in range(n)]
    for s in range(steps):
        comp = [0.010 * (1 + 0.03 * rng.random()) for _ in range(n)]
        tokens = [512] * n
        if slow is not None:
            comp[slow] *= factor
        if uneven is not None and s % 2:
            comp[uneven] *= 2
            tokens[uneven] = 1024
        top = max(comp)
        for r in range(n):
            rec = dict(step=s, zero_grad=1e-4, compute=comp[r], grad_sync=top - comp[r] + 0.002 + link,
                       stats=1e-4, wait_zero_grad=0.0, wait_compute=0.0, wait_grad_sync=top - comp[r],
                       wait_stats=0.0, link=link, tokens=tokens[r])
            per[r].append(rec)
    return per


def test_report_throttled_device():
    rep = debug.straggler_report(fake(slow=2))
    assert (rep.rank, rep.cause, rep.phase) == (2, "throttled device", "grad_sync"), rep.text
    assert 1.8 < rep.slowdown < 2.2 and "rank 2" in rep.text


def test_report_uneven_shard():
    rep = debug.straggler_report(fake(uneven=1))
    assert (rep.rank, rep.cause) == (1, "uneven shard"), rep.text


def test_report_slow_link_and_balanced():
    per = fake(link=0.030)
    rep = debug.straggler_report([{"rank": r, "records": p, "links": {"dp": ([0, 1], 0.3)}} for r, p in enumerate(per)])
    assert rep.rank is None and rep.cause == "slow link" and rep.link[:2] == ("dp", [0, 1]), rep.text
    assert debug.straggler_report(fake()).cause == "balanced"


def test_inject_parse():
    got = inject.parse("straggler:rank=2,slowdown=1.5; slow-link:ranks=0-1,gbps=1")
    assert got == [("straggler", {"rank": 2, "slowdown": 1.5}), ("slow-link", {"ranks": (0, 1), "gbps": 1.0})]
    assert inject.parse(["nan:rank=0,step=3", "exit:rank=1,step=4"])[1] == ("exit", {"rank": 1, "step": 4})
    for bad in ("straggle:rank=1", "straggler:rank=1", "nan:rank=x,step=1", "slow-link:ranks=1,gbps=2",
                "exception:rank=1,step=4,when=now"):
        with pytest.raises(ValueError):
            inject.parse(bad)


def test_topology_links_and_alpha_beta():
    t = topology.Topology("nodes=2x2,intra=300GB/s:2us,inter=12.5GB/s:10us")
    assert t.nodes() == [[0, 1], [2, 3]]
    assert t.link_for([0, 1]).name == "intra" and t.link_for([0, 2]).name == "inter"
    assert topology.Topology("nodes=0+2/1+3").link_for([0, 2]).name == "intra"
    # all-reduce of S on 4 ranks: 2(n-1)/n S ring bytes in 2(n-1) steps
    S = 4e6
    assert t.inter.seconds("all_reduce", 4, 1.5 * S) == pytest.approx(6 * 10e-6 + 1.5 * S / 12.5e9)
    assert t.inter.seconds("send", 2, S) == pytest.approx(10e-6 + S / 12.5e9)
    assert topology.parse_link("1Gbps:5us", "x").bw == pytest.approx(1.25e8)
    with pytest.raises(ValueError):
        topology.Topology("nodes=2x2,inter=fast")
    with pytest.raises(ValueError):
        t.link_for([0, 4])


def test_trace_instant_event():
    trace.clear()
    trace.instant("inject nan", cat="fault", rank=0)
    ev = trace.chrome_events(trace.events(), 0, 0.0)
    i = [e for e in ev if e["ph"] == "i"]
    assert len(i) == 1 and i[0]["s"] == "p" and i[0]["name"] == "inject nan" and "dur" not in i[0]
    trace.clear()


# ----------------------------------------------------------- under MPI
@pytest.mark.cores("all")      # timing-sensitive: alone under pytest-xdist (tests/conftest.py)
def test_detector_names_compute_straggler():
    got = reports(mpirun(4, W / "debug_worker.py", "detect", "straggler:rank=2,slowdown=3", 8, timeout=120))
    assert got[0]["rank"] == 2 and got[0]["cause"] == "throttled device", got


@pytest.mark.cores("all")      # timing-sensitive: alone under pytest-xdist (tests/conftest.py)
def test_detector_names_uneven_shard():
    got = reports(mpirun(4, W / "debug_worker.py", "detect", "uneven-shard:rank=1,extra=1.0", 32, timeout=120))
    assert got[0]["rank"] == 1 and got[0]["cause"] == "uneven shard", got


@pytest.mark.cores("all")      # timing-sensitive: alone under pytest-xdist (tests/conftest.py)
def test_simulated_cluster_layouts_order_as_predicted():
    """tp inside a node / dp across vs tp across / dp inside, inter-node 20 MB/s, 200 us."""
    got = reports(mpirun(4, W / "debug_worker.py", "layouts", 6, timeout=120))[0]
    a, b = got["tp-in-node"], got["tp-across"]
    assert a["pred_link_s"] < b["pred_link_s"], got           # more tp bytes and messages cross the slow link
    assert a["step_s"] < b["step_s"], got                     # and the measured step times agree,
    # by about the predicted difference (the link is charged: without it the two are one layout)
    assert b["step_s"] - a["step_s"] > 0.5 * (b["pred_link_s"] - a["pred_link_s"]), got


def validate_chrome_trace(doc):
    """The trace event format's required fields (Chrome's 'Trace Event Format' doc)."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "i", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "i":
            assert isinstance(e["ts"], (int, float)) and e["s"] in ("g", "p", "t"), e
    json.dumps(doc, allow_nan=False)


@pytest.mark.cores("all")      # timing-sensitive: alone under pytest-xdist (tests/conftest.py)
def test_lesson_08_passes_and_its_trace_validates(tmp_path):
    path, js = tmp_path / "trace.json", tmp_path / "s.json"
    run = launch(4, ROOT / "lessons" / "08_when_it_breaks.py", "--trace", path, "--json", js, timeout=180)
    out = run.out
    verdicts = "\n".join(ln for ln in out.splitlines() if ln.startswith(("PASS", "FAIL", "step time")))
    assert run.rc == 0 and "PASS: 08_when_it_breaks" in out and out.count("PASS: act") == 4, \
        (run.rc, verdicts or out[-3000:])
    assert json.loads(js.read_text())["check"] == "PASS"
    # act 3 says which rank skipped which collective, not "invalid arguments"
    assert "=> rank 3 skipped a collective: it never waited on all_reduce #" in out, out[-4000:]
    assert "invalid arguments" not in out and "ranks 0, 1, 2: all_reduce #" in out, out[-4000:]
    doc = json.loads(path.read_text())
    validate_chrome_trace(doc)
    ev = doc["traceEvents"]
    cats = {e.get("cat") for e in ev}
    assert {"comm", "compute", "wait", "link", "step", "fault"} <= cats, cats
    assert {e["pid"] for e in ev} == {0, 1, 2, 3}
    faults = [e for e in ev if e["ph"] == "i"]
    assert {e["pid"] for e in faults} == {1, 2}                 # the uneven shard on 1, the straggler on 2
