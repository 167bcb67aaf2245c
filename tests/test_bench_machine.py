"""bench/machine.py: every bench's header and JSON say where it ran."""
import importlib.util
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_machine():
    spec = importlib.util.spec_from_file_location("bench_machine", os.path.join(ROOT, "bench", "machine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_facts_header_and_record(tmp_path, monkeypatch):
    m = load_machine()
    f = m.facts()
    assert f["cpu"] and f["cpu_count"] == os.cpu_count() and 1 <= f["cores_usable"] <= os.cpu_count()
    assert f["numpy"] == np.__version__ and len(f["loadavg"]) == 3
    assert f["blas"] and all(b["internal_api"] for b in f["blas"])  # NumPy's BLAS, seen by threadpoolctl
    h = m.header("x", f)
    assert h.startswith("# x: ") and f["cpu"] in h and f["blas"][0]["internal_api"] in h
    monkeypatch.setenv("PDIST_BENCH_OUT", str(tmp_path))
    path = m.record("x", {"rows": [[1, 2.5]]})
    data = json.loads(open(path).read())
    assert path == str(tmp_path / "x.json")
    assert data["bench"] == "x" and data["rows"] == [[1, 2.5]] and data["machine"]["cpu"] == f["cpu"]
