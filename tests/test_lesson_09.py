"""lessons/09_context_parallel.py at 4 ranks (one small run): PASS, and its JSON summary
against formulas written out here: activation bytes per rank = e(26 sbh + a sb + 2 sb) at
s = T/cp, ring bytes (cp-1) K/V chunks forward and 2(cp-1) backward, Ulysses 4 all-to-alls of
(cp-1)/cp each way, the per-rank score elements of contiguous and zigzag chunks, and
GPT-2 / Llama under ring, zigzag and Ulysses equal one process with n_layer x those bytes on
the cp group per step. A bad size stops the lesson before any work."""
import json
import subprocess
import sys
from pathlib import Path

from shared_launch import scratch, world, text

REPO = Path(__file__).resolve().parent.parent
L09 = REPO / "lessons" / "09_context_parallel.py"
CP, B, H, C, LAYERS, MEM_T = 4, 4, 8, 32, 1, (16, 32)


def contiguous_work(T, cp):
    c = T // cp
    return [(r + 1) * c * c for r in range(cp)]      # rank r: r + 1 chunk pairs


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {"test_lesson_09_at_4_ranks": (CP, [L09, "--steps", "2", "--n-layer", LAYERS, "--mem-seq",
                                             ",".join(map(str, MEM_T)), "--repeats", "1", "--json", scratch("l09.json")])}


def test_lesson_09_at_4_ranks(request):
    out = text(request, world(CP, request))
    assert "PASS: 09_context_parallel" in out, out
    s = json.loads(Path(scratch("l09.json")).read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("09_context_parallel", CP, "PASS")
    memory, attn, work, *trains = s["runs"]
    hs, e = C // H, 8
    for row in memory["rows"]:
        sl = row["T"] // CP
        want = e * (26 * sl * B * C + H * sl * B + 2 * sl * B)
        assert row["cp"]["measured"] == row["cp"]["formula"] == want, row
        assert row["one_process"]["measured"] == row["one_process"]["formula"] > CP * want, row
    T = attn["T"]
    assert T == max(MEM_T)
    kv_chunk = 2 * B * (T // CP) * H * hs * e
    ulysses = (CP - 1) * B * (T // CP) * 4 * H * hs * e // CP
    want = {"ring": [(CP - 1) * kv_chunk, 2 * (CP - 1) * kv_chunk], "ring-zigzag": [(CP - 1) * kv_chunk,
                                                                                  2 * (CP - 1) * kv_chunk],
            "ulysses": [ulysses, ulysses]}
    for mode, w in want.items():
        assert attn["ops"][mode]["formula"] == w and attn["ops"][mode]["bytes_per_rank"] == [w] * CP, (mode, attn)
    c2 = T // (2 * CP)
    assert work["contiguous"]["measured"] == contiguous_work(T, CP)
    assert work["zigzag"]["measured"] == [(2 * CP + 1) * c2 * c2] * CP      # balanced
    assert [r["name"] for r in trains] == [f"{m} {c}" for m in ("gpt2", "llama")
                                           for c in ("ring", "ring-zigzag", "ulysses")]
    T = 16                                             # the training runs' --block-size default
    for r in trains:
        n_kv = H // 2 if r["model"] == "llama" else H
        chunk = 2 * B * (T // CP) * n_kv * hs * e
        per_layer = 3 * (CP - 1) * chunk if r["context_parallel"] != "ulysses" else \
            2 * ((CP - 1) * B * (T // CP) * (2 * H + 2 * n_kv) * hs * e // CP)
        assert r["check"] == "PASS" and r["comm_bytes_per_step"] == [LAYERS * per_layer] * CP, r
        assert r["tokens_per_rank"] == [B, T // CP] and r["layout"]["cp"] == CP
        assert all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(r["loss"], r["baseline_loss"]))


def test_lesson_09_refuses_a_sequence_zigzag_cannot_cut():
    p = subprocess.run([sys.executable, str(L09), "--block-size", "15"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "--block-size 15" in p.stderr and "multiple of 2" in p.stderr, p.stderr
