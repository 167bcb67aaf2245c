"""Mixed precision under mpiexec: every data-parallel / ZeRO / tensor / pipeline layout equals one
process in the same precision, fp16's overflow on one rank skips the step on every rank, and the
two-byte collectives sum in fp32 and round once (single-process tests: tests/test_precision.py).

The tests at one world size share one launch (tests/shared_launch.py, tests/workers/jobs.py): each
worker runs as a job named after the test that reads its reports; a job that fails ends the
launch and fails every test of it with the failing rank's traceback."""
import pytest

from shared_launch import chosen, own, world

W = "tests/workers/"
LAYOUTS = {2: ["--zero 0", "--zero 0 --naive", "--zero 1", "--zero 2", "--zero 3", "--precision fp16 --zero 2",
               "--tp 2", "--tp 2 --precision fp16"],
           4: ["--zero 0", "--zero 1", "--zero 2", "--zero 3", "--precision fp16 --zero 3", "--precision fp16 --zero 0",
               "--tp 2 --zero 0", "--tp 2 --zero 1", "--tp 2 --zero 3"]}
# pipeline and sequence parallelism: "case" = sizes (dp2 tp2 pp2 m4 v2, z1: ZeRO-1), schedule, precision, sp
PIPELINE_CASES = {2: ["pp2 gpipe bf16 m4", "pp2 1f1b fp16 m4", "pp2 interleaved v2 bf16 m2", "tp2 sp bf16",
                      "tp2 sp fp16 m2", "pp2 zb-h1 bf16 m4", "pp2 zb-v bf16 m2", "pp2 dualpipev fp16 m4"],
                  4: ["dp2 pp2 1f1b bf16 m2", "dp2 pp2 gpipe fp16 m2 z1", "dp2 pp2 1f1b bf16 z2",
                      "tp2 pp2 sp 1f1b bf16 m2", "dp2 tp2 sp fp16 z3"]}
OVERFLOW = {2: ["--zero 0 --pp 1", "--zero 0 --pp 2"], 4: ["--zero 2 --pp 1", "--zero 3 --pp 1", "--zero 1 --pp 2"]}


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py): those of ``names``."""
    return chosen({
        f"test_layout_equals_one_process_in_the_same_precision[n{n}]":
            [W + "precision_equiv.py", "--each=" + ";".join(LAYOUTS.get(n, []))],
        f"test_pipeline_and_sequence_parallel_equal_one_process[n{n}]":
            [W + "precision_pipeline.py", *PIPELINE_CASES.get(n, [])],
        f"test_fp16_overflow_on_one_rank_skips_on_every_rank[{n}]":
            [W + "precision_overflow.py", "--each=" + ";".join(OVERFLOW.get(n, []))],
        f"test_two_byte_collectives_sum_in_fp32_and_round_once[{n}]": [W + "comm_low_precision.py"]}, names)


@pytest.mark.parametrize("n", list(LAYOUTS), ids=[f"n{n}" for n in LAYOUTS])
def test_layout_equals_one_process_in_the_same_precision(n, request):
    """Masters, Adam's m and v and the low weights bit-for-bit (tp: to a few fp32 ulps); memory =
    the paper's formula; bytes sent over dp per step = the ring accounting of 2-byte elements.
    The worker trains each reference once, each layout asserted by name; a layout that fails
    ends the job with its name in the message."""
    out = world(n, request)
    got = own(request, out)
    for layout in LAYOUTS[n]:
        mine = [r for r in got if r["case"] == layout]
        assert sorted(r["rank"] for r in mine) == list(range(n)), (layout, out[-6000:])
        zero = int(layout.split("--zero ")[1].split()[0]) if "--zero" in layout else 0
        dp = n // (2 if "--tp 2" in layout else 1)
        s = 2 * mine[0]["psi"]                              # S: 2 bytes per element on the wire
        ring = {0: 2, 1: 2, 2: 2, 3: 3}[zero] * (dp - 1) * s / dp
        assert all(r["checked_pieces"] > 0 for r in mine), layout
        sent = [r["sent_per_step"] for r in mine]           # dp = 1: the group is tp's (activations)
        assert dp == 1 or all(abs(b - ring) <= 64 for b in sent), (layout, sent, ring)   # integer division


@pytest.mark.parametrize("n", list(PIPELINE_CASES), ids=[f"n{n}" for n in PIPELINE_CASES])
def test_pipeline_and_sequence_parallel_equal_one_process(n, request):
    """pp (every schedule, zero-bubble ones too) and dp x pp with m = 1 bit for bit; tp + sp (partial
    LayerNorm, bias, wpe grads summed before one rounding) to rtol 1e-6; dp x pp with m > 1 (one more rounding
    grouping) within 16 unit roundoffs of the update (tests/workers/precision_pipeline.py)."""
    cases = PIPELINE_CASES[n]
    got = own(request, world(n, request))
    assert sorted(r["rank"] for r in got) == list(range(n))
    for r in got:
        assert [c["case"] for c in r["results"]] == cases
        for c in r["results"]:
            if "rel_update_err" in c:
                assert c["rel_update_err"] <= 16 * c["u"], c
            else:
                assert c["checked"] > 0 and c["exact"] == ("tp2" not in c["case"]), c


@pytest.mark.parametrize("n", list(OVERFLOW))
def test_fp16_overflow_on_one_rank_skips_on_every_rank(n, request):
    """pp = 2: the overflow is on the last stage only; the first stage skips too."""
    out = world(n, request)
    got = own(request, out)
    for case in OVERFLOW[n]:
        mine = [r for r in got if r["case"] == case]
        assert len(mine) == n and all(r["log"] == mine[0]["log"] for r in mine), (case, mine, out[-6000:])
        log = mine[0]["log"]
        assert [e["changed"] for e in log] == [True, False, True, True], (case, log)
        assert [e["scale_next"] for e in log] == [1024, 512, 512, 1024], (case, log)
        assert log[2]["adam_steps_before"] == [1] and all(e["loss_finite"] for e in log), (case, log)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_two_byte_collectives_sum_in_fp32_and_round_once(n, request):
    """bf16 and fp16 all-reduce (sum, avg, max; sync and async; sizes not divisible by n),
    reduce-scatter, reduce to one rank, all-gather, broadcast: the exact bits of their
    definition; an all-reduce of S bytes counts 2(n-1)/n S (2 bytes per element)."""
    got = own(request, world(n, request))
    assert len(got) == n and all(r["checked"] == 88 and r["sum"] == n for r in got), got
    assert all(r["all_reduce_bytes"] == 2 * (n - 1) * 2000 // n for r in got), got
