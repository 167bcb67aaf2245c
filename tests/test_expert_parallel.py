"""Expert parallelism: its collective, all_to_all_v (variable rows along axis 0), at 2 and 4
ranks (tests/workers/moe_all_to_all_v.py), ExpertParallel against one process
(tests/workers/moe_expert_parallel.py), and composed with ZeRO-1/2/3, tp and pp
(tests/workers/moe_compose.py) at 4 and 8 ranks; one launch per world size, many cases."""
from pathlib import Path

import pytest

from pdist.testing import mpirun, reports

W = Path(__file__).parent / "workers"


@pytest.mark.parametrize("n, eps", [(2, ["2", "1"]), (4, ["2", "4"])])
def test_expert_parallel_equals_one_process(n, eps):
    """ep 2 / ep 1 x dp 2 at 2 ranks, ep 2 x dp 2 and ep 4 at 4 ranks; GPT (dropless) and Llama
    (capacity 1.0: drops): K AdamW steps, float64, every dense parameter, the router and
    every expert shard by shard (rtol 1e-9), the drops, and the all_to_all_v bytes exactly
    (from the counts; and tokens*k*h*(ep-1)/ep four times for a planted uniform routing).
    The same launch first runs all_to_all_v itself: uneven counts incl. zeros, 4 dtypes x 3
    shapes, mpi/pairwise/async, bytes exact, bad counts raise on every rank naming the pair;
    at 4 ranks also on the dp groups of a mesh. At 4 ranks the same launch runs the
    compositions: ep2 x dp2 ZeRO-1 (GPT), ZeRO-3 (Llama, drops) and ZeRO-2 from a zero router
    (experts without gradient at step 0: AdamW skips them on both sides), ep2 x tp2, ep2 x pp2
    (1F1B; ZB-V with ZeRO-1), each piece and its gradient against one process."""
    res = reports(mpirun(n, W / "moe_expert_parallel.py", *eps, timeout=120))
    assert sorted(r["rank"] for r in res) == list(range(n)) and all(r["ok"] for r in res)
    assert all(r["a2a_cases"] >= (96 if n == 2 else 192) for r in res)
    done = res[0]["done"]
    assert sorted({d["ep"] for d in done}) == sorted(int(e) for e in eps) and len(done) == 4
    assert all(d["a2a_bytes"] > 0 for d in done if d["ep"] > 1)
    assert len(res[0]["uniform"]) == sum(int(e) > 1 for e in eps)     # tokens k h (ep-1)/ep, 4 times
    if n == 4:
        assert [c["name"] for c in res[0]["compose"]] == ["ep2xdp2-zero1", "ep2xdp2-zero3", "ep2xdp2-zero2-zero-router",
                                                         "ep2xtp2", "ep2xpp2", "ep2xpp2-zbv-zero1"]
        assert res[0]["compose"][1]["drops"] > 0                           # capacity 1.0 dropped tokens


def test_expert_parallel_composes_at_8_ranks():
    """ep4 x dp2 ZeRO-1 (GPT) and ep2 x tp2 x dp2 ZeRO-2 (Llama, capacity 1.0: drops) against one
    process, float64: the loss per step, every piece of every parameter (the router, every
    expert, ZeRO's boxes, tp's blocks) and its gradient, rtol 1e-9; one launch."""
    res = reports(mpirun(8, W / "moe_compose.py", timeout=120))
    assert sorted(r["rank"] for r in res) == list(range(8)) and all(r["ok"] for r in res)
    assert [c["name"] for c in res[0]["compose"]] == ["ep4xdp2-zero1", "ep2xtp2xdp2-zero2"]
    assert res[0]["compose"][1]["drops"] > 0
