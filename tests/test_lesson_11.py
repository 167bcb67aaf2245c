"""lessons/11_same_bits.py at 4 ranks (dp 4 against dp 2 x tp 2, small flags): the JSON contract,
the bisector naming the first split sum, and a bad flag stopping before any training."""
import json
import subprocess
import sys
from pathlib import Path

from pdist.testing import mpirun

REPO = Path(__file__).resolve().parent.parent
L11 = REPO / "lessons" / "11_same_bits.py"


def test_lesson_11_at_4_ranks(tmp_path):
    path = tmp_path / "l11.json"
    out = mpirun(4, str(L11), "--steps", "3", "--n-embd", "16", "--block-size", "8", "--json", str(path),
                 timeout=150)
    assert "PASS: 11_same_bits" in out, out
    s = json.loads(path.read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("11_same_bits", 4, "PASS")
    act1, act2 = s["runs"]
    assert act1["layouts"] == ["dp 4", "dp 2 x tp 2"] and len(act1["loss"]) == 3
    # the first sum dp 2 x tp 2 splits and dp 4 does not: the first row-parallel matmul's K-sum
    assert (act1["exact_step"], act1["exact_phase"], act1["exact_op"]) == (0, "fwd", "transformer.h.0.attn.c_proj")
    assert act2["name"] == "deterministic"
    if act2["built"]:
        assert act2["identical"] and act2["cost_ratio"] > 0
    else:
        assert "deterministic mode not built yet" in out


def test_lesson_11_bad_flag():
    r = subprocess.run([sys.executable, str(L11), "--rtol", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--rtol 0.0 must be > 0" in r.stderr, r.stderr
