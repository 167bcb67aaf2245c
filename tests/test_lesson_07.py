"""lessons/07_checkpoint.py at 4 ranks: saved under ZeRO-3, the naive dump's failure
shown, loaded into dp 2 x tp 2, ZeRO-1 at dp 2 and one process, each continuation equal
to the uninterrupted run; the JSON summary; and a bad flag stops every rank."""
import json
import os

from pdist.testing import launch, mpirun

L07 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lessons", "07_checkpoint.py")


def test_lesson_07_at_4_ranks(tmp_path):
    path = tmp_path / "ckpt.json"
    out = mpirun(4, L07, "--steps", "6", "--save-at", "3", "--dir", tmp_path / "ckpt", "--json", path,
                 timeout=300)
    assert "PASS: 07_checkpoint" in out, out
    assert "the dump is tied to the layout that wrote it" in out, out       # the naive dump's failure
    assert os.path.exists(tmp_path / "ckpt" / "step-000003" / "index.json")
    s = json.loads(path.read_text())
    assert (s["lesson"], s["world_size"], s["check"]) == ("07_checkpoint", 4, "PASS")
    assert [r["name"] for r in s["runs"]] == ["dp 2 x tp 2", "ZeRO-1, dp 2", "1 process"]
    for r in s["runs"]:
        assert abs(r["loss"] - r["baseline_loss"]) <= 1e-9 * abs(r["baseline_loss"]) and r["rel_err"] < 1e-12


def test_lesson_07_needs_4_ranks_and_a_save_step():
    r = launch(2, L07, timeout=60, wrap=False)
    assert r.rc == 2 and r.out.count("run it with mpirun -n 4") == 2, r.out
    r = launch(4, L07, "--steps", "4", "--save-at", "4", timeout=60, wrap=False)
    assert r.rc == 2 and r.out.count("--save-at must be in [1, --steps)") == 4, r.out
