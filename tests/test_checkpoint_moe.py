"""Checkpoints reshard across ep and cp (issue 26, item 8; tests/workers/ckpt_moe.py): a
mixture-of-experts checkpoint saved at ep 4 loads at ep 2 (also under ZeRO-1, whose expert
shards span the edp group) and at one process, and a dense one saved at cp 2 x dp 2 loads
at cp 1 and at one process; each continues equal (float64, rtol 1e-9) to the uninterrupted
run: every parameter (the router, every expert) and AdamW's m, v and step. An expert is
its own tensor under its single-process name, so ep rank r's file holds experts
[r E/ep, (r+1) E/ep) whole, and loading is the same box intersection as for any cut."""
import json
from pathlib import Path

from pdist.testing import mpirun, reports

W = Path(__file__).parent / "workers" / "ckpt_moe.py"


def test_moe_and_cp_checkpoints_load_at_other_ep_and_cp(tmp_path):
    saved = reports(mpirun(4, W, "save", tmp_path, timeout=120))
    assert sorted(r["rank"] for r in saved) == [0, 1, 2, 3] and all(r["ok"] for r in saved)
    index = json.loads((tmp_path / "moe" / "index.json").read_text())
    assert index["layout"]["mesh"] == {"dp": 4, "tp": 1, "pp": 1, "ep": 4}
    for e in range(4):                                          # expert e whole in ep rank e's file
        slices = index["tensors"][f"model.layers.1.mlp.experts.{e}.up_proj.weight"]["slices"]
        assert [s["file"] for s in slices] == [f"rank-{e:05d}.safetensors"], slices
        assert len(index["tensors"][f"optimizer.exp_avg.model.layers.0.mlp.experts.{e}.down_proj.weight"]
                   ["slices"]) == 1
    cp = json.loads((tmp_path / "cp" / "index.json").read_text())
    assert cp["layout"]["mesh"] == {"dp": 2, "tp": 1, "pp": 1, "cp": 2}
    res = reports(mpirun(2, W, "resume", tmp_path, timeout=120))
    assert sorted(r["rank"] for r in res) == [0, 1] and all(r["ok"] for r in res)
    cases = [c["case"] for c in res[0]["cases"]]
    assert len(cases) == 5 and sum("local" in c for c in cases) == 2 and any("'zero': 1" in c for c in cases)
    assert all(c["pieces"] > 0 for r in res for c in r["cases"])
