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
    assert sum(ok for *_, ok in rows) >= 61                     # the hit rate reported in the docs
    held_out = [ok for c, *_, ok in rows if not c.get("fitted")]
    assert sum(held_out) >= 0.8 * len(held_out)                 # the goal: >= 80% of the cases not fitted to
    new = [ok for c, *_, ok in rows if c.get("added")]
    assert len(new) >= 6 and all(c.get("added") or c.get("planned") is not None for c in cases)


def test_a_case_can_state_what_published_runs_report():
    """Hidden cases must be expressible: a cluster edited as the CLI edits one, the quantities runs
    report (step time, job tokens/s, HFU, GPU hours per 10¹² tokens, memory), and a clear error
    naming the case and the accepted keys for anything else."""
    import pytest
    c = {"id": "x", "quantity": "mfu", "model": "gpt3-175b", "cluster": {"preset": "a100", "gpu_memory_gib": 40,
         "inter_bw_gbs": 12.5}, "layout": {"dp": 8, "tp": 8, "pp": 16, "sp": True, "recompute": "full"},
         "global_batch": 1536}
    q = {k: published.predict(dict(c, quantity=k)) for k in ("mfu", "hfu", "step_s", "tokens_per_s",
                                                             "tokens_per_gpu_s", "gpu_hours_per_t_tokens", "memory_gb")}
    assert q["hfu"] > q["mfu"] and q["tokens_per_s"] == pytest.approx(1536 * 2048 / q["step_s"])
    assert q["gpu_hours_per_t_tokens"] == pytest.approx(1e12 / q["tokens_per_gpu_s"] / 3600)
    slow = published.predict(dict(c, quantity="step_s", cluster={"preset": "a100", "inter_bw_gbs": 1}))
    assert slow > published.predict(dict(c, quantity="step_s", cluster="a100"))
    for bad, msg in (({"cluster": {"preset": "a100", "nvlink": 1}}, "unknown cluster edit 'nvlink'"),
                     ({"layout": {"tpp": 2}}, "unknown layout keys ['tpp']"), ({"model": "gpt9"}, "unknown model"),
                     ({"model": {"name": "m", "width": 3}}, "model: .*the fields are name, vocab"),
                     ({"quantity": "days"}, "unknown quantity 'days'")):
        with pytest.raises(ValueError, match="case x: " + msg.replace("[", r"\[")):
            published.predict(dict(c, **bad))
