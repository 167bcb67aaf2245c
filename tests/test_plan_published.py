"""The published runs in docs/planning.md, recomputed from pdist/plan/cases.json so the table cannot rot:
every stored prediction and verdict equals what the planner computes now, and the docs hold the table
the data gives (in process, about a second)."""
import os

from pdist.plan import published

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_published_cases_are_current_and_in_the_docs():
    cases = published.load()
    assert len(cases) >= 20 and len({c["id"] for c in cases}) == len(cases)
    for c in cases:                     # tolerances fixed in advance: 2% formula, 15% measured
        assert c["source"] and c["tolerance"] == {"formula": 0.02, "measured": 0.15}[c["kind"]], c["id"]
    rows = published.verdicts(cases)
    assert published.stale(rows) == [], "rerun the planner on cases.json (python -m pdist.plan.published)"
    with open(os.path.join(ROOT, "docs", "planning.md")) as f:
        assert published.markdown(rows) in f.read(), "docs/planning.md: paste `python -m pdist.plan.published`"
    assert sum(ok for *_, ok in rows) >= 42                     # the hit rate reported in the docs
    held_out = [ok for c, *_, ok in rows if not c.get("fitted")]
    assert sum(held_out) >= 0.8 * len(held_out)                 # the goal: >= 80% of the cases not fitted to
    new = [ok for c, *_, ok in rows if c.get("added")]
    assert len(new) >= 6 and all(c.get("added") or c.get("planned") is not None for c in cases)
