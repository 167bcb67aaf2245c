"""The measured waterfall (pdist/measure/waterfall.py): parts that add up to the step on every
lesson layout, the FLOP conventions, the trace's track, --waterfall, and the straggler
detector under DDP's overlapped buckets (pdist/faults/debug.py, skew.py)."""
import json
from pathlib import Path

import pytest

from pdist.faults import debug
from pdist.measure import blocked, flops, waterfall, waterfall_table
from pdist.models.gpt import GPTConfig
from pdist.models.llama import LlamaConfig
from pdist.testing import launch, mpirun, reports

ROOT = Path(__file__).resolve().parent.parent
W = ROOT / "tests" / "workers" / "waterfall_worker.py"
TOL = waterfall_table.CHECK          # the parts sum to the step within 3%


# ----------------------------------------------------------- no MPI
def test_flop_conventions():
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)
    n = flops.matmul_params(cfg)
    assert n == cfg.num_params() - 32 * 64              # all but the position table (wte is the tied head)
    lht = 2 * 64 * 32
    assert flops.per_token(cfg, "6N") == 6 * n
    assert flops.per_token(cfg, "6N+12LhT") == 6 * n + 12 * lht
    assert flops.per_token(cfg, "causal") == 6 * n + 6 * lht and flops.DEFAULT == "6N+12LhT"
    llama = LlamaConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)
    assert flops.matmul_params(llama) == llama.num_params() - 96 * 64     # embed_tokens is a lookup
    with pytest.raises(ValueError, match="convention must be one of"):
        flops.per_token(cfg, "6ND")
    with pytest.raises(ValueError, match="convention must be one of"):
        waterfall.Waterfall(convention="6n")
    assert flops.gemm_rate() > 1e6


def test_one_process_parts_and_trace_track():
    """One process, no MPI world: a step's parts, the sum, the trace's waterfall track."""
    from pdist.engine.backend import set_default_dtype
    from pdist.measure import trace
    from pdist.models.gpt import GPT
    from pdist.parallel import Local
    import numpy as np
    set_default_dtype("float64")
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, recompute="full")
    model = Local(GPT(cfg, 0))
    wf = waterfall.Waterfall(model)
    x = np.random.default_rng(0).integers(0, 32, (4, 8))
    trace.clear()
    for _ in range(2):
        wf.start()
        model.forward_backward(x, x)
        parts = wf.stop()
    wf.close()
    assert wf not in __import__("pdist.engine.hooks", fromlist=["x"]).subscribers()
    assert parts["recompute"] > 0 and parts["ideal compute"] > 0 and min(parts.values()) >= 0, parts
    r = wf.records[-1]
    assert sum(parts.values()) == pytest.approx(r["step_s"], rel=1e-9)
    assert r["mfu"]["6N"] < r["mfu"]["causal"] < r["mfu"]["6N+12LhT"] and wf.mfu == r["mfu"]
    track = [e for e in trace.events() if e["cat"] == "waterfall"]
    assert {e["name"] for e in track} >= {"ideal compute", "recompute"}
    last = [e for e in track if e["start"] >= r["t0"]]
    assert sum(e["end"] - e["start"] for e in last) == pytest.approx(r["step_s"], rel=1e-6)
    text = waterfall_table.render([wf.summary()])
    assert "sum / step" in text and "MFU 6N+12LhT*" in text and "within 3% on every rank: True" in text
    with pytest.raises(RuntimeError, match="without start"):
        wf.stop()


def test_skew_names_who_holds_the_others_up():
    """Records of 3 ranks: rank 1 arrives 20 ms after the others at every collective."""
    recs = []
    for r in range(3):
        rows = []
        for s in range(5):
            ent = [(("dp", (0, 1, 2), 10 * s + c), s + c * 0.05 + (0.020 if r == 1 else 0.001 * r), c % 2)
                   for c in range(3)]
            rows.append(dict(step=s, zero_grad=0.0, compute=0.01, grad_sync=0.02, stats=0.0, wait_zero_grad=0.0,
                             wait_compute=0.0, wait_grad_sync=0.01, wait_stats=0.0, link=0.0, tokens=64,
                             blocked_compute=0.0, entries=ent))
        recs.append(rows)
    rep = debug.straggler_report(recs, skip=0)
    assert rep.rank == 1 and rep.cause == "throttled device" and "arrivals" in rep.text, rep.text
    assert rep.late[1] == pytest.approx(0.018) and rep.late[0] == 0.0, rep.late


# ----------------------------------------------------------- under MPI
def _check_layouts(got):
    for name, per_rank in got.items():
        if name in ("detector", "cpu_s"):
            continue
        for rank, steps in enumerate(per_rank):
            # the parts add up to the step on the worker's own clock (the median step: a core
            # taken away between the two clocks' reads inflates one step's sum, as lesson 08's
            # timing claims take medians) and, but the remainder (framework overhead), never
            # exceed it on any step: no interval counted twice
            ratios = sorted(st["ratio"] for st in steps)
            assert abs(ratios[len(ratios) // 2] - 1) <= TOL, (name, rank, steps)
            for st in steps:
                assert st["measured"] <= 1 + TOL, (name, rank, st)
                assert min(st["parts"].values()) >= 0 and st["parts"]["ideal compute"] > 0, (name, rank, st)


@pytest.mark.cores(2)
def test_parts_sum_to_the_step_on_every_layout_2_ranks():
    got = reports(mpirun(2, W, 2, timeout=240))[0]
    print("cpu_s", got.pop("cpu_s"))
    assert set(got) == {"dp", "dp-recompute", "zero-1", "zero-3", "tp", "pp"}, got.keys()
    _check_layouts(got)
    mean = lambda name, part: sum(st["parts"].get(part, 0.0) for r in got[name] for st in r)  # noqa: E731
    assert mean("dp-recompute", "recompute") > 0 and mean("dp", "recompute") == 0
    assert mean("pp", "pipeline bubble") > 0 and mean("dp", "pipeline bubble") == 0
    assert mean("tp", "comm tp") > 0 and mean("zero-3", "comm dp") > 0, got["tp"]


@pytest.mark.cores("all")      # the detector is timing-sensitive: alone under pytest-xdist
def test_mesh_parts_and_detector_under_ddp_overlap():
    got = reports(mpirun(4, W, 4, timeout=300))[0]
    det = got.pop("detector")
    print("cpu_s", got.pop("cpu_s"))
    assert set(got) == {"mesh-dp-tp", "mesh-dp-pp"}
    _check_layouts(got)
    for fault, rep in det.items():
        late = {int(k): v for k, v in rep["late"].items()}
        assert rep["buckets"] > 4 and rep["rank"] == 2 and rep["cause"] == "throttled device", (fault, rep)
        assert max(late, key=late.get) == 2, (fault, rep)      # it arrives last: it holds the others up
        # the waterfall: rank 2's compute is the largest, and the others' wait for it is waiting
        parts = rep["parts"]
        comp = [p["ideal compute"] + p["kernel inefficiency"] for p in parts]
        wait = [p["waiting for slower rank"] for p in parts]
        assert max(range(4), key=comp.__getitem__) == 2 and min(range(4), key=wait.__getitem__) == 2, (fault, parts)
        assert min(wait[q] for q in (0, 1, 3)) > 0.5 * (comp[2] - max(comp[q] for q in (0, 1, 3))), (fault, parts)


def test_lesson_waterfall_flag(tmp_path):
    """--waterfall on a training lesson: validated by argparse, a table per run with the sum check."""
    from pdist.course import lesson
    p = lesson.parser()
    assert p.parse_args(["--waterfall"]).waterfall == flops.DEFAULT
    assert p.parse_args(["--waterfall", "causal"]).waterfall == "causal" and p.parse_args([]).waterfall is None
    with pytest.raises(SystemExit) as e:                   # argparse: usage error, exit 2, before any work
        p.parse_args(["--waterfall", "6NX"])
    assert e.value.code == 2
    trace_path = tmp_path / "t.json"
    run = launch(2, ROOT / "lessons" / "04_tensor_parallel.py", "--steps", "2", "--n-layer", "1",
                 "--waterfall", "--trace", trace_path, timeout=180)
    assert run.rc == 0 and "waterfall: TensorParallel > Local" in run.out, run.out[-3000:]
    assert run.out.count("within 3% on every rank: True") >= 2 and "rank 1" in run.out, run.out[-3000:]
    doc = json.loads(trace_path.read_text())
    assert any(e.get("cat") == "waterfall" and e["pid"] == 1 for e in doc["traceEvents"])


def test_blocked_is_off_without_consumers():
    """Nothing recorded unless a consumer is on (the detector counts as one once imported)."""
    on = blocked.ON[0]
    debug.disable()
    assert blocked.ON[0] == on - 1
    debug.enable()
    debug.enable()                     # again: a no-op, still one consumer
    assert blocked.ON[0] == on
