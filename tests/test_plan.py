"""pdist.plan, checked three ways: against pdist's own measured runs (lessons 03 and 06, byte
for byte), against the ZeRO paper's per-device memory (Ψ = 7.5 B, N_d = 64), and against
Korthikanti et al. 2022 (Table 2, activations per layer) and Narayanan et al. 2021 (Table 1,
TFLOP/s per GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdist.models.gpt import GPTConfig
from pdist.plan import main, plan, search, text_chart
from pdist.plan.model import Layout, layer_activations
from pdist.plan.presets import CLUSTERS, MODELS, NARAYANAN_TABLE1, narayanan_flops
from shared_launch import chosen, scratch, world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lesson_cfg(psi, n_layer, C=64, T=32, heads=4):
    """The lesson's GPTConfig, its vocabulary recovered from Ψ = V·C + T·C + L(12C² + 13C) + 2C."""
    rest = psi - T * C - n_layer * (12 * C * C + 13 * C) - 2 * C
    assert rest % C == 0
    cfg = GPTConfig(vocab_size=rest // C, block_size=T, n_layer=n_layer, n_head=heads, n_embd=C)
    assert cfg.num_params() == psi
    return cfg


# --- 1. pdist's own runs -----------------------------------------------------------------------

L03, L06 = os.path.join(ROOT, "lessons", "03_zero.py"), os.path.join(ROOT, "lessons", "06_mesh.py")
LAYOUTS_06 = {"--dp 2 --tp 2": "m-dp2tp2.json", "--tp 2 --pp 2": "m-tp2pp2.json"}


def suite_jobs(n, names):
    """This module's jobs at n ranks, for ``world`` (tests/shared_launch.py):
    lesson 03 (at 3 ranks a job tests/test_lessons_02_03.py shares: the same run), and at 4 each
    lesson 06 layout, each writing its JSON."""
    spec = {f"test_lesson_03_bytes_equal_the_plan[{n}]": [L03, "--steps", "2", "--json", scratch(f"z-n{n}.json")]}
    if n == 4:
        spec |= {f"test_lesson_06_memory_and_group_bytes_equal_the_plan[{a}-lay{i}]":
                 [L06, "--steps", "2", *a.split(), "--json", scratch(f)] for i, (a, f) in enumerate(LAYOUTS_06.items())}
    spec = chosen(spec, names)
    if n == 3 and spec:                                                  # the shared job's name
        spec = {"::lesson 03 at 3 ranks, 2 steps": spec.popitem()[1]}
    return spec


def runs(request, n, name):
    """The runs of the JSON a lesson wrote in the launch at n ranks."""
    world(n, request)
    return json.loads(Path(scratch(name)).read_text())["runs"]


@pytest.mark.parametrize("n", [2, 3, 4])     # n = 3: units padded to a multiple of 3
def test_lesson_03_bytes_equal_the_plan(n, request):
    s = {"runs": runs(request, n, f"z-n{n}.json")}
    assert len(s["runs"]) == 4
    for run in s["runs"]:
        cfg = lesson_cfg(run["params"], 2)
        stage = run["layout"]["zero_stage"]
        p = plan(cfg, "this", dp=n, zero=stage, precision="fp32", micro_batch=12 // n)
        (st,) = p["memory_per_stage"]
        assert len(run["memory_per_rank"]) == n
        for m in run["memory_per_rank"]:          # every rank, every category, exactly
            assert (m["params_bytes"], m["grads_bytes"], m["optim_bytes"]) == \
                (st["params"], st["grads"], st["optimizer"]), (stage, m, st)
        for sent in run["comm_bytes_per_step"]:   # ring accounting, within the lesson's own slack
            assert abs(sent - st["comm_bytes"]["dp"]) <= cfg.n_layer + 2, (stage, sent, st["comm_bytes"])


@pytest.mark.parametrize("layout,lay", [
    ("--dp 2 --tp 2", dict(dp=2, tp=2, pp=1, zero=1, sp=True)),
    ("--tp 2 --pp 2", dict(dp=1, tp=2, pp=2, zero=0, sp=True)),
])
def test_lesson_06_memory_and_group_bytes_equal_the_plan(layout, lay, request):
    (run,) = runs(request, 4, LAYOUTS_06[layout])
    cfg = lesson_cfg(run["params"], 4)
    m = 4                                                        # the lesson's --microbatches
    p = plan(cfg, "this", precision="fp64", m=m, micro_batch=16 // lay["dp"] // m, **lay)
    for mem, sent in zip(run["memory_per_rank"], run["comm_bytes_per_group"]):
        pp_rank = mem["rank"] // (lay["dp"] * lay["tp"])         # world = (pp·DP + dp)·TP + tp
        st = p["memory_per_stage"][pp_rank]
        assert [mem["params_bytes"], mem["grads_bytes"], mem["optim_bytes"]] == \
            [st["params"], st["grads"], st["optimizer"]], (mem, st)
        for k in ("dp", "tp", "pp"):
            assert abs(sent[k] - st["comm_bytes"][k]) <= 64, (k, sent, st["comm_bytes"])


# --- 2. the ZeRO paper ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_gpus(stage, gb):
    """Rajbhandari et al. 2020, Figure 1 / Table 1: Ψ = 7.5 B, N_d = 64, K = 12 (decimal GB)."""
    out = subprocess.run([sys.executable, "-m", "pdist.plan", "--params", "7.5e9", "--dp", "64", "--zero",
                          str(stage), "--precision", "mixed", "--accounting", "paper", "--json"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    j = json.loads(out)
    m = j["memory_per_gpu"]
    assert m["activations"] is None and j["time_per_step"] is None
    assert m["total"] == m["params"] + m["grads"] + m["optimizer"]
    assert round(m["total"] / 1e9, 1) == gb
    psi = 7.5e9
    assert m["optimizer"] == 12 * psi / (64 if stage else 1)


# --- 3. Korthikanti et al. 2022 and Narayanan et al. 2021 -----------------------------------------

@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_table_2(t):
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert layer_activations(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert layer_activations(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_activations(s, b, h, a, t, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert layer_activations(s, b, h, a, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activations(s, b, h, a, t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert layer_activations(s, b, h, a, t, sp=True, recompute="full") == 2 * sbh


def test_pipeline_stash():
    """1F1B's first stage holds p micro-batches of L/p layers (L layers' worth, Korthikanti §4.2.3),
    GPipe m, interleaved L·(1 + (p−1)/(p·v))."""
    cfg, p, m = MODELS["gpt3-175b"], 8, 16
    A = layer_activations(2048, 1, 12288, 96, 8, sp=True, recompute="selective")
    L = cfg.n_layer

    def act(**kw):
        return plan(cfg, tp=8, pp=p, m=m, sp=True, recompute="selective", **kw)["memory_per_stage"][0]["activations"]
    assert act() == pytest.approx(L * A, rel=1e-9)
    assert act(schedule="gpipe") == pytest.approx(m * L / p * A, rel=1e-9)
    assert act(schedule="interleaved", v=2) == pytest.approx(L * A * (1 + (p - 1) / (p * 2)), rel=1e-9)


def test_narayanan_table_1_within_10_percent():
    """Every row of Table 1 (A100, mixed precision, V 51200, s 2048), planned as 1F1B with micro-batch 1,
    full recompute, sequence-parallel pipeline sends (Narayanan's scatter/gather), the a100 preset's
    GEMM profile (fitted to this table: a consistency check, not an independent one): the paper's
    Eq. 3 FLOPs over the predicted step time is within 10% of the reported TFLOP/s."""
    for P, a, h, L, t, p, n, B, tflops, pct in NARAYANAN_TABLE1:
        cfg = GPTConfig(vocab_size=51200, block_size=2048, n_layer=L, n_head=a, n_embd=h)
        assert abs(cfg.num_params() / 1e9 - P) <= 0.05 + 0.001 * P     # the table rounds Ψ
        r = plan(cfg, "a100", dp=n // (t * p), tp=t, pp=p, sp=True, recompute="full", global_batch=B)
        assert r["fits"]
        pred = narayanan_flops(B, 2048, L, h, 51200) / n / r["time_per_step"]["total"] / 1e12
        assert abs(pred / tflops - 1) < 0.10, (P, pred, tflops)
        assert sum(r["waterfall"].values()) == pytest.approx(r["time_per_step"]["total"], rel=1e-12)
        if P == 1008.0:
            assert {k: r["links"][k] for k in ("tp", "dp", "pp")} == {"tp": "intra-node", "dp": "inter-node",
                                                                     "pp": "inter-node"}


# --- the planner's own behaviour -------------------------------------------------------------------

def test_tp_across_nodes_swamps_compute():
    cfg = MODELS["gpt3-175b"]
    inside = plan(cfg, tp=8, pp=16, dp=1, sp=True, recompute="selective", global_batch=64)
    across = plan(cfg, tp=16, pp=8, dp=1, sp=True, recompute="selective", global_batch=64)
    assert inside["links"]["tp"] == "intra-node" and across["links"]["tp"] == "inter-node"
    assert across["time_per_step"]["comm_tp"] > 5 * inside["time_per_step"]["comm_tp"]
    assert across["time_per_step"]["comm_tp"] > across["time_per_step"]["compute"]


def test_search_ranks_collapses_and_no_longer_prefers_zero2_with_a_pipeline(capsys):
    plans = search("gpt2-xl", "a100", gpus=16, global_batch=64)
    assert plans and all(p["fits"] and p["gpus"] == 16 and 8 % p["layout"]["tp"] == 0 for p in plans)
    keys = [(float(f"{p['time_per_step']['total']:.3g}"), -p["headroom"]) for p in plans]
    assert keys == sorted(keys)                                         # time, then headroom
    shapes = [tuple(p["layout"][k] for k in ("dp", "tp", "pp", "recompute")) + (keys[i][0],)
              for i, p in enumerate(plans)]
    assert len(shapes) == len(set(shapes)) and any(p["ties"] for p in plans)    # ZeRO ties collapsed
    # pdist's ZeRO-2 keeps the full gradient across micro-batches: with a pipeline it saves nothing
    assert not any(p["layout"]["zero"] == 2 and p["layout"]["pp"] > 1 for p in plans)
    paper = search("gpt2-xl", "a100", gpus=16, global_batch=64, accounting="paper")
    assert any(p["layout"]["zero"] == 2 and p["layout"]["pp"] > 1 for p in paper)   # the old mis-ranking
    assert not search("gpt3-175b", "a100", gpus=8, global_batch=8)      # 175 B does not fit on one node
    main(["--model", "gpt2", "--cluster", "this", "--gpus", "2", "--precision", "fp32", "--global-batch", "16",
          "--search", "--top", "3"])
    out = capsys.readouterr().out
    for said in ("peak", "alpha", "beta", "efficiency:", "overlap:", "bytes: ring accounting", "memory: pdist",
                 "fits = under 90%"):
        assert said in out, said
    rows = [line for line in out.splitlines() if line.startswith("dp")]
    assert not any(" z1" in r for r in rows if r.startswith("dp1 "))          # no ZeRO without dp


def test_cli_errors_are_argparse_errors(capsys):
    """Every bad input ends as an argparse error (exit 2, a message naming the flag), never a traceback."""
    bad = [(["--search"], "--search needs --gpus"),
           (["--n-layer", "4", "--n-embd", "64"], "needs --n-head"),
           (["--dp", "0"], "--dp: '0' must be >= 1"),
           (["--dp", "4", "--ep", "3", "--n-expert", "6"], "ep = 3 must divide dp = 4"),
           (["--ep", "2", "--dp", "2"], "needs a mixture-of-experts model"),
           (["--pp", "2", "--zero", "3", "--m", "2"], "ZeRO-3 does not compose with pipeline"),
           (["--tp", "5"], "tp = 5 must divide"),
           (["--n-layer", "2", "--n-head", "3", "--n-embd", "64"], "divisible"),
           (["--cp", "3"], "must divide by cp = 3"),
           (["--fit-fraction", "1.5"], "fit_fraction")]
    for argv, msg in bad:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err, (argv, err)
    with pytest.raises(SystemExit):
        main(["--help"])
    helps = capsys.readouterr().out
    from pdist.plan.cli import _parser
    assert all(a.help for a in _parser()._actions), "every flag has help"   # and so its default, printed
    for flag in ("--cp", "--ep", "--n-expert", "--expert-top-k", "--gpu-memory", "--gpus-per-node", "--intra-bw",
                 "--inter-bw", "--peak-tflops", "--grad-dtype", "--fit-fraction"):
        assert flag + " " in helps, flag


def test_zero3_with_a_pipeline_is_refused_with_pdists_own_words():
    from types import SimpleNamespace

    from pdist.parallel.parallelize import check_layout
    from pdist.plan.layout import ZERO3_PIPELINE
    mesh = SimpleNamespace(dp_world_size=1, tp_world_size=1, pp_world_size=2, cp_world_size=1, ep_world_size=1)
    with pytest.raises(ValueError) as pdist_says:
        check_layout(GPTConfig(n_layer=2), mesh, zero_stage=3, microbatches=2)
    with pytest.raises(ValueError) as plan_says:
        plan("gpt2", pp=2, zero=3, m=2)
    assert str(pdist_says.value) == str(plan_says.value) == ZERO3_PIPELINE


def test_text_chart_and_bad_layouts():
    p = plan("gpt2", "a100", dp=8, zero=1)
    assert "|" in text_chart([p], CLUSTERS["a100"].memory)
    with pytest.raises(ValueError, match="ZeRO-3 does not compose"):
        plan("gpt2", pp=2, zero=3)
    with pytest.raises(ValueError, match="tp = 5 must divide"):
        plan("gpt2", tp=5)
    assert Layout(dp=2, tp=4, pp=8).gpus == 64


def test_plan_never_imports_mpi():
    code = "import sys, pdist.plan; sys.exit(any(m.startswith('mpi4py') or m.startswith('pdist.comm') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_readmes_planner_example_is_what_the_planner_prints():
    """The README's ``$ python -m pdist.plan ...`` block is the command's output, line for line
    (it went stale once: its pp column predated a change of the pp model)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = [b.split("\n```")[0] for b in text.split("```\n$ python -m pdist.plan ")[1:]]
    assert blocks, "the README has no planner example"
    for b in blocks:
        args, _, shown = b.partition("\n")
        got = subprocess.run([sys.executable, "-m", "pdist.plan", *args.split()], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        assert got.rstrip("\n") == shown.rstrip("\n"), f"README: python -m pdist.plan {args}\n{got}"


def test_fp8_runs_the_linear_layers_at_the_fp8_peak_and_attention_and_the_head_at_bf16():
    """Transformer Engine's and torchtitan's Float8 convert the linear layers only (DeepSeek-V3 keeps
    attention and the output head in their precision too): under fp8 a layer's GEMMs take about half their
    bf16 time (the peak doubles), its attention scores and the head the same time as in bf16."""
    from pdist.plan.arch import arch_of
    from pdist.plan.efficiency import head_time, layer_time
    a, cl = arch_of(MODELS["llama3-8b"]), CLUSTERS["h100"]
    fp8, bf16 = Layout(precision="fp8", seq_len=8192), Layout(precision="mixed", seq_len=8192)
    (g8, s8, _), (g16, s16, _) = layer_time(a, fp8, 8192, cl), layer_time(a, bf16, 8192, cl)
    assert g8 == pytest.approx(g16 / 2, rel=0.01) and s8 == pytest.approx(s16, rel=1e-9)   # (a few GEMMs are memory-bound)
    assert head_time(a, fp8, 8192, cl) == pytest.approx(head_time(a, bf16, 8192, cl), rel=1e-9)
    assert "fp8 linears; attention and the head at 989 bf16" in main_output(["--model", "llama3-8b", "--cluster",
                                                                            "h100", "--dp", "8", "--precision", "fp8"])


def main_output(argv):
    r = subprocess.run([sys.executable, "-m", "pdist.plan", *argv], cwd=ROOT, capture_output=True, text=True, check=True)
    return r.stdout
