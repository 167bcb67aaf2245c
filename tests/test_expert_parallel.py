"""Expert parallelism: its collective, all_to_all_v (variable rows along axis 0), at 2 and 4
ranks (tests/workers/moe_all_to_all_v.py), ExpertParallel against one process
(tests/workers/moe_expert_parallel.py), composed with ZeRO-1/2/3, tp and pp
(tests/workers/moe_compose.py) at 4 and 8 ranks, and checkpoints across ep and cp
(tests/workers/ckpt_moe.py); one launch per world size, many cases."""
import json
from pathlib import Path

from pdist.testing import mpirun, reports
from shared_launch import own, world

W = Path(__file__).parent / "workers"


def _run(n, *args):
    res = reports(mpirun(n, W / "moe_expert_parallel.py", *args, timeout=150))
    assert sorted(r["rank"] for r in res) == list(range(n)) and all(r["ok"] for r in res)
    assert all(r["a2a_cases"] >= (96 if n == 2 else 192) for r in res)
    done = res[0]["done"]
    eps = [int(a) for a in args[:2]]
    assert sorted({d["ep"] for d in done}) == sorted(eps) and len(done) == 4
    assert all(d["a2a_bytes"] > 0 for d in done if d["ep"] > 1)
    assert len(res[0]["uniform"]) == sum(e > 1 for e in eps)           # tokens k h (ep-1)/ep, 4 times
    return res


def test_expert_parallel_equals_one_process_and_checkpoints_reshard(tmp_path):
    """ep 2 x dp 2 and ep 4 at 4 ranks, then ep 2 / ep 1 x dp 2 at 2 ranks; GPT (dropless) and
    Llama (capacity 1.0: drops): K AdamW steps, float64, every dense parameter, the router and
    every expert shard by shard (rtol 1e-9), the drops, and the all_to_all_v bytes exactly
    (from the counts; and tokens*k*h*(ep-1)/ep four times for a planted uniform routing).
    Each launch first runs all_to_all_v itself: uneven counts incl. zeros, 4 dtypes x 3
    shapes, mpi/pairwise/async, bytes exact, bad counts raise on every rank naming the pair;
    at 4 ranks also on the dp groups of a mesh. The 4-rank launch then runs the compositions:
    ep2 x dp2 ZeRO-1 from a zero router (experts without gradient at step 0: AdamW skips them
    on both sides) and ZeRO-3 (Llama; and top-1 on 2-token rows, 2 micro-batches, so an expert
    is used in one ep group and not in the other: every edp rank must gather it alike), ep2 x
    tp2, ep2 x pp2 with the load-balancing loss (1F1B; ZB-V with ZeRO-1), each piece and its
    gradient against one process.

    Checkpoints (issue 26, item 8): the 4-rank launch saves a Llama MoE at ep 4 and a GPT at
    cp 2 x dp 2 after one step; the 2-rank launch loads the first at ep 2, ep 2 x ZeRO-1 and
    one process, the second at cp 1 (dp 2) and one process, and each continues equal (rtol
    1e-9) to the uninterrupted run: every parameter, the router, every expert, AdamW's m, v
    and step. An expert is its own tensor, so ep rank r's file holds expert r whole."""
    res = _run(4, "2", "4", "--ckpt", "save", tmp_path)
    assert [c["name"] for c in res[0]["compose"]] == ["ep2xdp2-zero1", "ep2xdp2-zero3", "ep2xdp2-zero3-sparse",
                                                     "ep2xtp2", "ep2xpp2", "ep2xpp2-zbv-zero1"]
    drops = {c["name"]: c["drops"] for c in res[0]["compose"]}
    assert all(drops[c] > 0 for c in ("ep2xdp2-zero1", "ep2xdp2-zero3", "ep2xpp2-zbv-zero1")), drops  # capacity 1
    index = json.loads((tmp_path / "moe" / "index.json").read_text())
    assert index["layout"]["mesh"] == {"dp": 4, "tp": 1, "pp": 1, "ep": 4}
    for e in range(4):                                          # expert e whole in ep rank e's file
        slices = index["tensors"][f"model.layers.1.mlp.experts.{e}.up_proj.weight"]["slices"]
        assert [s["file"] for s in slices] == [f"rank-{e:05d}.safetensors"], slices
        assert len(index["tensors"][f"optimizer.exp_avg.model.layers.0.mlp.experts.{e}.down_proj.weight"]
                   ["slices"]) == 1
    assert json.loads((tmp_path / "cp" / "index.json").read_text())["layout"]["mesh"] == \
        {"dp": 2, "tp": 1, "pp": 1, "cp": 2}
    res = _run(2, "2", "1", "--ckpt", "resume", tmp_path)
    cases = [c["case"] for c in res[0]["ckpt"]]
    assert len(cases) == 5 and sum("local" in c for c in cases) == 2 and any("'zero': 1" in c for c in cases)
    assert all(c["pieces"] > 0 for r in res for c in r["ckpt"])


# the 8-rank test's job, in the suite's 8-rank launch (tests/shared_launch.py; the 4- and 2-rank
# launches above run in order: the second resumes the first's checkpoints)
SUITE_JOBS = {"test_expert_parallel_composes_at_8_ranks": (8, [W / "moe_compose.py"])}


def test_expert_parallel_composes_at_8_ranks(request):
    """ep2 x tp2 x dp2 ZeRO-2 (Llama, capacity 1.0: drops) against one process, float64: the
    loss per step, every piece of every parameter (the router, every expert, ZeRO's boxes of
    the edp shards, tp's blocks) and its gradient, rtol 1e-9."""
    res = own(request, world(8, request))
    assert sorted(r["rank"] for r in res) == list(range(8)) and all(r["ok"] for r in res)
    assert [c["name"] for c in res[0]["compose"]] == ["ep2xtp2xdp2-zero2"] and res[0]["compose"][0]["drops"] > 0
