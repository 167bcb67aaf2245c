"""lessons/10_experts.py at 4 ranks, one small run: PASS (ep 2 and ep 4 equal one process,
float64, every parameter by its global name: the router and every expert), and the JSON
summary's numbers equal their formulas exactly: each rank's all_to_all_v bytes per step =
2 (S + R) C b from the counts, a planted uniform routing = 4 N k C b (ep-1)/ep, the drops at
capacity 1.0 / 1.25 = sum_e max(0, routed_e - ceil(c N k / E)), expert memory = E/ep of the
replicated. And a bad --ep stops every rank with one usage message."""
import json
import os
from pathlib import Path

from shared_launch import own, scratch, stops, world, text

L10 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons", "10_experts.py")


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {"test_lesson_10_at_4_ranks": (4, [L10, "--steps", "2", "--n-embd", "16", "--block-size", "8",
                                              "--json", scratch("l10.json")]),
              "test_lesson_10_bad_ep_stops_every_rank": (2, stops(L10, "--ep", "4"))}     # it stops before any work


def test_lesson_10_at_4_ranks(request):
    out = text(request, world(4, request))
    assert "PASS: 10_experts" in out and "tokens per expert" in out, out
    s = json.loads(Path(scratch("l10.json")).read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("10_experts", 4, "PASS")
    runs = {r["name"]: r for r in s["runs"]}
    assert list(runs) == ["ep 2", "ep 4", "capacity", "uniform routing"]
    N, C, k, b = 2 * 8, 16, 2, 8                      # tokens per rank per layer: B/dp x T
    for ep in (2, 4):
        r = runs[f"ep {ep}"]
        assert r["layout"]["ep"] == ep and r["layout"]["dp"] == 4 and len(r["loss"]) == 2
        assert all(abs(a - w) <= 1e-9 * abs(w) for a, w in zip(r["loss"], r["baseline_loss"]))
        for m in r["memory_per_rank"]:
            assert m["expert_params_bytes"] == m["formula_bytes"] == m["replicated_bytes"] // ep > 0, m
        for rank_steps, rank_layers in zip(r["a2a_bytes_per_step"], r["a2a_bytes_per_layer"]):
            assert all(st["measured"] == st["exact"] == sum(lay.values()) > 0
                       for st, lay in zip(rank_steps, rank_layers)), rank_steps
        assert r["a2a_uniform_formula_per_step"] == 2 * 4 * N * k * C * b * (ep - 1) // ep      # 2 layers
        assert [sum(v) for v in r["tokens_per_expert"][0].values()] == [4 * N * k] * 2      # dropless: all N k kept
    assert [(u["ep"], u["measured"]) for u in runs["uniform routing"]["a2a_bytes"]] == \
        [(ep, 4 * N * k * C * b * (ep - 1) // ep) for ep in (2, 4)]
    assert all(u["measured"] == u["formula"] for u in runs["uniform routing"]["a2a_bytes"])
    drops = {d["capacity_factor"]: d for d in runs["capacity"]["drops"]}
    assert drops[None]["dropped"] == 0 and drops[1.0]["dropped"] > drops[1.25]["dropped"] > 0
    assert all(d["dropped"] == d["formula"] and d["assignments"] == 2 * 2 * 4 * N * k for d in drops.values())


def test_lesson_10_bad_ep_stops_every_rank(request):
    got = own(request, world(2, request))          # exit 2 on every rank, with one usage message
    assert sorted(r["rank"] for r in got) == [0, 1], got
    assert all(r["code"] == 2 and r["out"].count("--ep 4: must be >= 2, divide the world (2 ranks") == 1
               for r in got), got
