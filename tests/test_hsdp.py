"""HSDP (pdist/parallel/zero/hsdp.py) under real mpiexec, at dp_replicate 2 x dp_shard 2 (4 ranks)
and x tp 2 (8 ranks), one job of the suite's launch at each size (tests/workers/hsdp_check.py):
the mesh's rank order and groups, each group's bytes per step against the formulas and against
pdist.plan's HSDP numbers, and the refusals (every rank, before any collective). Equivalence
with one process is in tests/test_layouts.py (its HSDP layouts), checkpoints in
tests/test_checkpoint.py, with context parallelism in tests/test_context_parallel.py, lesson 03's
--dp-shard in tests/test_zero.py, lesson 06's in tests/test_lesson_06.py."""
import pytest

from shared_launch import chosen, own, world

WORKER = "tests/workers/hsdp_check.py"
R, S = 2, 2


def suite_jobs(n, names):
    every = {f"test_hsdp_mesh_bytes_and_refusals[{m}]": (m, [WORKER, "--tp", m // (R * S)]) for m in (4, 8)}
    return chosen(every, names, n)


@pytest.mark.parametrize("n", [4, 8])
def test_hsdp_mesh_bytes_and_refusals(n, request):
    got = own(request, world(n, request))
    by = {}
    for r in got:
        by.setdefault(r["case"], []).append(r)
    tp = n // (R * S)
    mesh = sorted(by["mesh"], key=lambda r: r["rank"])
    assert [r["rank"] for r in mesh] == list(range(n)), got
    # world rank = (dp_replicate_rank * S + dp_shard_rank) * tp + tp_rank: the shard group is a block of
    # S·tp consecutive ranks (one node), the replicas go across
    assert mesh[0]["shard_ranks"] == [s * tp for s in range(S)] and mesh[0]["replicate_ranks"] == [r * S * tp for r in range(R)]
    assert mesh[n - 1]["shard_ranks"] == [(S + s) * tp + tp - 1 for s in range(S)]
    for stage, case in [(1, "bytes stage 1"), (2, "bytes stage 2"), (3, "bytes stage 3")] + \
            [(2, "bytes stage 2 cp 2")] * (tp == 1):         # the shard group: dp_shard 1 x cp 2
        rows = by[case]
        assert len(rows) == n, rows
        for r in rows:
            for g in ("shard", "replicate"):       # exact: S = R = 2 and 8-byte elements leave no rounding
                assert r["sent"][g] == r["want"][g] > 0, (stage, g, r)
                assert r["planned"][g] == pytest.approx(r["want"][g], rel=1e-12), (stage, g, r)
            assert r["ops"] == {"shard": ["all_gather", "reduce_scatter"], "replicate": ["all_reduce"]}, r
            if "cp" not in case:     # pdist.plan.measured reads HSDP off the chain: each group on its own link
                assert r["read"] == {"dp": R * S, "shard": S, "zero": stage, "groups": {
                    "dp": r["groups"]["shard"], "dp_rep": r["groups"]["replicate"]}}, r
    words = {"dp disagrees": "dp must equal dp_replicate * dp_shard", "experts": "mixture-of-experts",
             "deterministic": "deterministic mode",
             "zero-3 x pp": "ZeRO-3 does not compose with pipeline", "stage 0": "stage 0 over the whole dp group",
             "mode": "HSDP does not run in the deterministic mode yet"}
    for case, w in words.items():
        rows = by[case]
        assert sorted(r["rank"] for r in rows) == list(range(n)), (case, rows)
        assert all(r["error"] and w in r["error"] for r in rows), (case, rows)
        assert len({r["error"] for r in rows}) == 1, (case, rows)          # the same message on every rank
