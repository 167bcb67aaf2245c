"""Zero-bubble pipelines run (issue 27 part 3): ZB-H1, ZB-V and DualPipeV through
``parallelize(..., schedule=...)`` equal one process, float64, rtol 1e-9, shard by shard.

One real mpiexec launch per world size (tests/workers/zero_bubble.py loops over its
cases and reports each): at 2 and 4 ranks every new schedule with p = the world size and
m = p and 2p, for GPT-2 (tied embedding) and Llama; at 4 ranks also dp 2 x pp 2 for every
schedule and both models, tp 2 (+SP) x pp 2, and ZeRO-1 and ZeRO-2 x pp 2; at 2 ranks
two with recompute (selective, full) and one built on device="meta". The peak stash per rank is the planned one. Every case
must have held memory between B and W and released it. Then the layouts that do not
compose are refused on every rank with the reason: ZeRO-3 with a pipeline, and a V-shaped
schedule with other than 2 chunks per rank. (bf16/fp16 under these schedules, bit for
bit: tests/test_precision_layouts.py.)
"""
import pytest

from shared_launch import own, world

W = "tests/workers/zero_bubble.py"
SCHEDULES = ("zb-h1", "zb-v", "dualpipev")


def _expected(n):
    """The case names the worker must report, each from every rank."""
    names = [f"{mod} dp=1 tp=1 pp={n} zero=0 sp=False {s} m={m}" for s in SCHEDULES for m in (n, 2 * n)
             for mod in ("gpt2", "llama")]
    if n == 2:
        names += ["gpt2 dp=1 tp=1 pp=2 zero=0 sp=False zb-h1 m=2 recompute=selective",
                  "llama dp=1 tp=1 pp=2 zero=0 sp=False zb-v m=2 recompute=full",
                  "gpt2 dp=1 tp=1 pp=2 zero=0 sp=False zb-v m=2 meta"]
    if n == 4:
        names += [f"{mod} dp=2 tp=1 pp=2 zero=0 sp=False {s} m=2" for s in SCHEDULES for mod in ("gpt2", "llama")]
        names += ["gpt2 dp=1 tp=2 pp=2 zero=0 sp=True zb-v m=2", "llama dp=2 tp=1 pp=2 zero=1 sp=False zb-h1 m=4",
                  "gpt2 dp=2 tp=1 pp=2 zero=2 sp=False dualpipev m=2"]
    return names


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {f"test_zero_bubble_schedules_equal_one_process[{n}]": (n, [W]) for n in (2, 4)}


@pytest.mark.parametrize("n", [2, 4])
def test_zero_bubble_schedules_equal_one_process(n, request):
    got = own(request, world(n, request))
    cases = [r for r in got if "case" in r]
    for name in _expected(n):
        mine = [r for r in cases if r["case"] == name]
        assert sorted(r["rank"] for r in mine) == list(range(n)), (name, mine)
        assert all(r["checked"] > 0 and r["peak_held_w_bytes"] > 0 for r in mine), mine
        v = " zb-v " in name or "dualpipev" in name
        assert all(r["chunks"] == (2 if v else 1) and r["placement"] == ("v" if v else "loop") for r in mine), mine
    assert len(cases) == n * len(_expected(n))
    refused = {(r["refused"], r["rank"]): r["error"] for r in got if "refused" in r}
    for rank in range(n):
        assert "ZeRO-3" in refused[("zb-h1", rank)] and "zero_stage <= 2" in refused[("zb-h1", rank)]
        assert "zb-v" in refused[("zb-v", rank)]
