"""The one shape: every layout and composition equals single-process training, for every model.

tests/workers/layout_equiv.py runs K AdamW steps through the one training loop
(pdist.training.train) on a ``parallelize``d GPT-2 and Llama (one job of one launch per world size
for all of its layouts and both models, tests/shared_launch.py) and checks, on every rank: the losses, every piece of every parameter and of
Adam's m and v in ``sharded_state_dict`` against the same box of the single-process tensors
(float64, rtol 1e-9), ``full_state_dict`` against the single-process state_dict, and
``load_full_state_dict`` as its inverse.
Also: non-finite values raise NonFiniteError on every rank (tests/workers/nonfinite.py),
and bad layouts raise before any collective."""
import re

import pytest

from pdist.testing import mpirun, reports
from shared_launch import own, stops, world

W = "tests/workers/layout_equiv.py"
MODELS = ("gpt2", "llama")
LAYOUTS = [
    (1, "--microbatches 2"),
    (2, "--dp 2"), (2, "--dp 2 --naive --microbatches 2"), (2, "--dp 2 --zero 1"), (2, "--dp 2 --zero 2"),
    (2, "--dp 2 --zero 3 --microbatches 2"), (2, "--tp 2"), (2, "--tp 2 --sp"),
    (2, "--pp 2 --schedule gpipe --microbatches 2"), (2, "--pp 2 --schedule interleaved --chunks 2 --microbatches 2"),
    (3, "--dp 3 --zero 2 --batch-size 12"),                                     # ZeRO padding: 3 does not divide the units
    (4, "--dp 2 --tp 2"), (4, "--dp 2 --tp 2 --zero 1 --sp"), (4, "--dp 2 --tp 2 --zero 3 --sp"),
    (4, "--tp 2 --pp 2 --sp --microbatches 2"), (4, "--dp 2 --pp 2 --microbatches 4"),
    (4, "--dp 2 --pp 2 --zero 2 --microbatches 2 --schedule gpipe"), (4, "--dp 4 --zero 3"),
    (8, "--dp 2 --tp 2 --pp 2 --zero 1 --sp --microbatches 4"),
    (8, "--dp 2 --tp 2 --pp 2 --schedule interleaved --chunks 2 --microbatches 4"),
    # meta init (GPT(cfg, seed, device="meta")): each rank draws only its pieces, in chunks that cut
    # rows; the worker checks them against GPT(cfg, seed) to the bit, then trains as above
    (2, "--dp 2 --meta"), (2, "--dp 2 --zero 1 --meta"), (2, "--dp 2 --zero 3 --meta"), (2, "--tp 2 --sp --meta"),
    (2, "--pp 2 --schedule gpipe --microbatches 2 --meta"), (4, "--dp 2 --tp 2 --zero 3 --sp --meta"),
    (4, "--tp 2 --pp 2 --zero 2 --microbatches 2 --meta"),
    # HSDP (dp_replicate x dp_shard): ZeRO inside each shard group, shards averaged across the replicas
    (4, "--dp-replicate 2 --dp-shard 2 --zero 1"), (4, "--dp-replicate 2 --dp-shard 2 --zero 2 --microbatches 2"),
    (4, "--dp-replicate 2 --dp-shard 2 --zero 3 --meta"),
    (8, "--dp-replicate 2 --dp-shard 2 --tp 2 --zero 1 --sp"), (8, "--dp-replicate 2 --dp-shard 2 --tp 2 --zero 3"),
    (8, "--dp-replicate 2 --dp-shard 2 --pp 2 --zero 2 --microbatches 2 --schedule gpipe"),
]


BAD = [
    (4, "--dp 2 --pp 2 --zero 3 --microbatches 2", "ZeRO-3 does not compose with pipeline parallelism"),
    (3, "--tp 3 --dp 1 --pp 1", "divisible by 3"),
    (4, "--dp 3 --tp 1 --pp 1", "dp*tp*pp = 3 but the world has 4"),
    (4, "--pp 4 --n-layer 2", "4 (virtual) stages but only 2 layers"),
    (4, "--tp 4 --dp 1 --pp 1 --model llama", "not divisible: n_kv_head = 2"),   # GQA: kv heads split whole
]


def ident(n, layout):
    """A layout's test id: "n4-dp-2-tp-2-zero-3-sp" for (4, "--dp 2 --tp 2 --zero 3 --sp")."""
    return "-".join([f"n{n}", *layout.replace("--", "").split()])


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py): the bad layouts
    of this session's tests at n, the non-finite cases, then every layout (one --each job of the
    worker: one reference per model). A layout that fails ends the job naming it, and fails every
    test of the launch with the failing rank's traceback."""
    each = [a for m, a in LAYOUTS if m == n and f"test_layouts_equal_single_process[{ident(m, a)}]" in names]
    spec = {f"bad {a}": stops(W, *a.split()) for m, a, w in BAD if m == n      # each raises on every rank
            and f"test_bad_layout_fails_on_every_rank[{m}-{a}-{w}]" in names}   # before any work
    if f"test_nonfinite_raises_on_every_rank[{n}]" in names:
        spec["nonfinite"] = ["tests/workers/nonfinite.py"]
    if each:
        spec["layouts"] = [W, "--each=" + ";".join(each), "--model", ",".join(MODELS)]
    return spec


@pytest.mark.parametrize("n,layout", LAYOUTS, ids=[ident(n, a) for n, a in LAYOUTS])
def test_layouts_equal_single_process(n, layout, request):
    """The layout, in its world size's launch: every rank reports every model, with its own
    (pp, dp, tp) coordinates."""
    out = world(n, request)
    got = own(request, out, "layouts")
    for name in MODELS:
        mine = [r for r in got if r["model"] == name and r["case"] == layout]
        assert sorted(r["rank"] for r in mine) == list(range(n)), (layout, name, out[-6000:])
        assert all(r["checked_pieces"] > 0 and r["steps"] == 3 for r in mine), (layout, name, mine)
        if "--dp-replicate" in layout:                             # built as HSDP, not ZeRO over all of dp
            assert all(r["chain"][0] == "HSDP" for r in mine), (layout, mine[0]["chain"])
        coords = {tuple(r["coords"]) for r in mine}
        assert len(coords) == n, (layout, coords)                  # every rank its own (pp, dp, tp)


@pytest.mark.parametrize("n", [2, 4])
def test_nonfinite_raises_on_every_rank(n, request):
    got = own(request, world(n, request), "nonfinite")
    for zero in (0, 1, 3):
        mine = [r for r in got if r["case"] == f"nan weight zero={zero}"]
        assert len(mine) == n, got
        for r in mine:       # every rank stops at the poisoned step, naming it and the rank
            assert r["steps_done"] == 2 and r["error"].startswith("step 2: non-finite loss on rank(s) ["), r
            assert str(n - 1) in r["error"].split("]")[0], r
    clip = [r for r in got if r["case"] == "inf grad clip"]
    assert len(clip) == n and all(r["error"] and "inf" in r["error"] and r["untouched"] for r in clip), clip


@pytest.mark.parametrize("n,args,words", BAD)
def test_bad_layout_fails_on_every_rank(n, args, words, request):
    """The layout raises the same error on every rank, before any work (a job of the world's
    launch, which goes on: tests/workers/jobs.py)."""
    got = own(request, world(n, request), f"bad {args}")
    assert sorted(r["rank"] for r in got) == list(range(n)), got
    assert all(r["code"] != 0 and words in r["error"] for r in got), got


@pytest.mark.parametrize("n,case,zero", [(2, "one", 0), (4, "one", 1), (2, "two", 0), (4, "two", 2)])
def test_a_skipped_step_is_caught_on_every_rank(n, case, zero):
    got = reports(mpirun(n, "tests/workers/skip_step.py", case, zero, timeout=120))
    assert sorted(r["rank"] for r in got) == list(range(n)), got
    for r in got:
        assert r["error"] and "disagree on step" in r["error"], r
        assert max(r["done"] or [0]) <= 2, r            # nobody trained past the skipped step
    off, at = {"one": (1, 3), "two": (0, 2)}[case]
    assert all(re.search(rf"rank {off} (is )?at step {at}", r["error"]) for r in got), got
