"""lessons/11_same_bits.py at 4 ranks (dp 4 against dp 2 x tp 2, small flags): the JSON contract,
the bisector naming the first split sum, and a bad flag stopping before any training."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from shared_launch import scratch, world, text

REPO = Path(__file__).resolve().parent.parent
L11 = REPO / "lessons" / "11_same_bits.py"


def _blas_cut_invariant(T=8, C=16, trials=20):
    """Does x W give a dp 4 rank's rows (2 rows of T tokens) the bits a dp 2 x tp 2 rank gives them
    (4 rows, the first half of W's 3C columns)? The lesson's c_attn at --n-embd 16 --block-size 8."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    with threadpool_limits(1):                 # as each of the 4 ranks on 2 cores runs it
        return all(_cut_same(rng, T, C) for _ in range(trials))


def _cut_same(rng, T, C):
    x = rng.standard_normal((4 * T, C), dtype=np.float32)                        # (4 T, C)
    w = rng.standard_normal((C, 3 * C), dtype=np.float32)                        # (C, 3C)
    return np.array_equal((x[:2 * T] @ w)[:, :3 * C // 2], (x @ np.ascontiguousarray(w[:, :3 * C // 2]))[:2 * T])


# its jobs in the suite's launches (tests/shared_launch.py), which it joins at every size (few groups)
SUITE_AT = (1, 2, 3, 4, 8)
SUITE_JOBS = {"test_lesson_11_at_4_ranks": (4, [L11, "--steps", "3", "--n-embd", "16", "--block-size", "8",
                                             "--json", scratch("l11.json")])}


def test_lesson_11_at_4_ranks(request):
    out = text(request, world(4, request))
    assert "PASS: 11_same_bits" in out, out
    s = json.loads(Path(scratch("l11.json")).read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("11_same_bits", 4, "PASS")
    act1, act2 = s["runs"]
    assert act1["layouts"] == ["dp 4", "dp 2 x tp 2"] and len(act1["loss"]) == 3
    # the first op whose bits part: the first row-parallel matmul's K-sum (c_proj), which dp 2 x tp 2
    # splits and dp 4 does not; or, where this BLAS gives a row other bits in a GEMM of other rows or
    # columns (OpenBLAS's Haswell sgemm), the first column-parallel one (c_attn) already
    first = "transformer.h.0.attn.c_proj" if _blas_cut_invariant() else "transformer.h.0.attn.c_attn"
    assert (act1["exact_step"], act1["exact_phase"], act1["exact_op"]) == (0, "fwd", first)
    assert act2["name"] == "deterministic"
    assert act2["identical"] and act2["cost_ratio"] > 0


def test_lesson_11_bad_flag():
    r = subprocess.run([sys.executable, str(L11), "--rtol", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--rtol 0.0 must be > 0" in r.stderr, r.stderr
