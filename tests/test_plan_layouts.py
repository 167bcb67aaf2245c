"""pdist.plan on the models and layouts beyond GPT-2 x dp/tp/pp: Llama (GQA, SwiGLU, untied),
mixture of experts with expert parallelism, context parallelism, and memory as pdist and the
frameworks hold it (in process, no MPI, well under a second)."""
import pytest

from pdist.models.gpt import GPTConfig
from pdist.models.llama import LlamaConfig
from pdist.plan import main, plan
from pdist.plan.arch import arch_of
from pdist.plan.presets import CLUSTERS, MODELS

MOE = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32, n_expert=8, expert_top_k=2)


def test_parameters_equal_pdists_models_total_and_active():
    for cfg in (MOE, LlamaConfig(n_kv_head=2), LlamaConfig(n_kv_head=2, n_expert=4), MODELS["gpt2"]):
        assert arch_of(cfg).num_params() == cfg.num_params()
    a = arch_of(MOE)
    expert = 2 * 32 * 128 + 128 + 32
    assert a.num_params() - a.num_params(active=True) == 2 * (8 - 2) * expert     # 2 layers, E - k experts idle
    assert round(arch_of(MODELS["llama3-8b"]).num_params() / 1e9, 2) == 8.03      # Meta's 8.03 B
    mix = arch_of(MODELS["mixtral-8x7b"])
    assert round(mix.num_params() / 1e9, 1) == 46.7 and round(mix.num_params(active=True) / 1e9, 1) == 12.9


def test_expert_memory_and_all_to_all_bytes():
    """Experts E/ep per rank (sharded over dp·cp/ep by ZeRO), the all-to-all 4·tokens·k·h·k_a·(ep−1)/ep
    per MoE layer and micro-batch, over the link it crosses."""
    a, base = arch_of(MOE), plan(MOE, "a100", dp=8, precision="fp32", m=2)
    dense = base["memory_per_gpu"]["params"] / 4 - 2 * 8 * (2 * 32 * 128 + 128 + 32)
    for ep in (2, 4, 8):
        p = plan(MOE, "a100", dp=8, ep=ep, precision="fp32", m=2)
        assert p["memory_per_gpu"]["params"] / 4 == dense + 2 * (8 // ep) * (2 * 32 * 128 + 128 + 32)
        sent = p["memory_per_stage"][0]["comm_bytes"]["ep"]
        assert sent == pytest.approx(2 * a.moe_layers * 4 * 16 * 2 * 32 * 4 * (ep - 1) / ep, rel=1e-12)
    small = CLUSTERS["a100"].__class__(**dict(vars(CLUSTERS["a100"]), gpus_per_node=2))
    assert plan(MOE, small, dp=8, ep=4)["links"]["ep"] == "inter-node"
    assert plan(MOE, "a100", dp=8, ep=4)["links"]["ep"] == "intra-node"
    assert not any("mixture of experts" in w for w in plan(MOE, "a100", dp=2, ep=2, tp=2)["warnings"])
    assert any("mixture of experts with cp > 1" in w for w in plan(MOE, "a100", dp=2, ep=2, cp=2)["warnings"])


def test_context_parallel_divides_activations_and_sends_kv():
    cfg = MODELS["llama3-8b"]
    one, four = (plan(cfg, "h100", dp=2, cp=c, recompute="selective", precision="mixed") for c in (1, 4))
    assert four["memory_per_stage"][0]["activations"] == pytest.approx(one["memory_per_stage"][0]["activations"] / 4)
    a, s = arch_of(cfg), 8192 // 4
    ring = 32 * 3 * 3 * 2 * s * a.n_kv_head * a.head_dim * 2
    assert four["memory_per_stage"][0]["comm_bytes"]["cp"] == ring
    uly = plan(cfg, "h100", dp=2, cp=4, cp_mode="ulysses")["memory_per_stage"][0]["comm_bytes"]["cp"]
    assert uly == pytest.approx(32 * 2 * (2 * 4096 + 2 * 1024) * s * 2 * 3 / 4)
    assert four["exposed"]["cp"] < four["time_per_step"]["comm_cp"]             # the ring hides behind attention


def test_memory_as_pdist_deepspeed_and_megatron_hold_it():
    psi, N = 7.5e9, 64
    def states(**kw):
        m = plan(psi, "a100", dp=N, precision="mixed", **kw)["memory_per_gpu"]
        return m["params"] + m["grads"] + m["optimizer"] + m["grad_sum"]
    assert states(zero=0, accounting="megatron") == 18 * psi                      # bf16 params, fp32 main grads
    assert states(zero=1, accounting="megatron") == pytest.approx((6 + 12 / N) * psi)   # distributed optimizer
    assert states(zero=2, accounting="deepspeed") == pytest.approx(4 * psi + 16 * psi / N)  # DeepSpeed's estimator
    assert states(zero=3, accounting="deepspeed") == pytest.approx(18 * psi / N)
    assert states(zero=1) - states(zero=1, accounting="paper") == pytest.approx(4 * psi / N)  # pdist's fp32 W.grad
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
    g = {(z, m): plan(cfg, "this", dp=4, zero=z, m=m, precision="fp32")["memory_per_gpu"]["grads"]
         for z in (1, 2) for m in (1, 4)}
    assert g[2, 1] < g[1, 1] and g[2, 4] > g[1, 4]          # pdist's ZeRO-2 keeps the full gradient at m > 1
    ds = plan(cfg, "this", dp=4, zero=2, m=4, precision="fp32", accounting="deepspeed")["memory_per_gpu"]["grads"]
    assert ds == g[1, 4]
    with pytest.raises(ValueError, match="DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only"):
        plan(cfg, "this", pp=2, m=2, zero=2, accounting="deepspeed")
    p = plan("gpt2", "a100", dp=8)
    assert p["memory_per_gpu"]["reserve"] > CLUSTERS["a100"].reserve and p["memory_per_gpu"]["logits"] == 2 * 4 * 1024 * 50257
    assert p["headroom"] == pytest.approx(0.9 * 80 * 2 ** 30 - p["memory_per_gpu"]["total"])
    assert not plan("gpt2", "a100", dp=8, fit_fraction=1e-3)["fits"]


def test_waterfall_parts_overlap_and_warnings():
    p = plan("gpt3-175b", "a100", dp=8, tp=16, pp=8, sp=True, m=4, recompute="selective")
    w = p["waterfall"]
    assert set(w) == {"ideal_compute", "inefficiency", "recompute", "bubble", "wait", "overhead"} | {
        f"comm:{g}" for g in ("tp", "cp", "ep", "pp", "dp")}
    assert sum(w.values()) == pytest.approx(p["time_per_step"]["total"], rel=1e-12)
    from pdist.plan.timing import as_measured
    assert as_measured(w)["pipeline bubble"] == w["bubble"] and as_measured(w)["comm tp"] == w["comm:tp"]
    assert any("crosses nodes" in x for x in p["warnings"]) and any("m = 4 < pp = 8" in x for x in p["warnings"])
    off = plan("gpt3-175b", "a100", dp=8, tp=16, pp=8, sp=True, m=4, recompute="selective", overlap=False)
    assert off["exposed"]["dp"] == off["time_per_step"]["comm_dp"] > p["exposed"]["dp"]
    assert off["exposed"]["tp"] == p["exposed"]["tp"]                           # tensor parallelism stays exposed
    big, small = (plan(MODELS["gpt2"], "a100", dp=1, micro_batch=b) for b in (16, 1))
    assert big["mfu"] > small["mfu"]                                            # bigger GEMMs run nearer peak


def test_cli_plans_moe_cp_and_a_users_cluster(capsys):
    assert main(["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--n-expert", "8", "--expert-top-k", "2",
                 "--dp", "4", "--ep", "4", "--cp", "2", "--seq-len", "16", "--vocab-size", "96",
                 "--gpu-memory", "24", "--gpus-per-node", "4", "--intra-bw", "100", "--inter-bw", "10",
                 "--peak-tflops", "100"]) == 0
    out = capsys.readouterr().out
    assert "active per token" in out and "dp4 tp1 pp1 cp2 ep4 z0" in out and "24.00 GiB each" in out
    assert "peak 100 TFLOP/s" in out and "inter-node beta 10 GB/s" in out and "ep,dp" in out.replace("dp,ep", "ep,dp")


def test_llama_activations_count_gqa_and_swiglu_tensors():
    """Per layer, 2-byte units: 8sbh unsplit (no dropout masks) + Q 2 + K, V 4·a_kv/a + 2 + SwiGLU
    3·2f/h, and 2as²b of scores (no dropout) unless selective recompute."""
    cfg = LlamaConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    sbh, f = 16 * 1 * 32, cfg.intermediate_size
    per = sbh * (8 + 2 + 4 * 2 / 4 + 2 + 6 * f / 32)
    act = {rc: plan(cfg, "this", recompute=rc)["memory_per_stage"][0]["activations"] for rc in ("selective", "none")}
    assert act["selective"] == round(2 * per)
    assert act["none"] == round(2 * (per + sbh * 2 * 4 * 16 / 32))
    flash = plan(cfg, "this", attention="flash")
    assert flash["memory_per_stage"][0]["activations"] == act["selective"]       # FlashAttention keeps no scores
    assert flash["time_per_step"]["total"] < plan(cfg, "this")["time_per_step"]["total"]   # and skips masked blocks


def test_mla_offload_causal_cp_and_the_new_presets(capsys):
    """MLA's parameters as DeepSeek-V3 counts them; causal attention under cp runs (cp+1)/(2cp) of the
    scores; ZeRO-Offload moves the optimizer (and ZeRO-Infinity the shards) off the GPU and charges
    PCIe + CPU Adam; the newer GPU presets plan; the CLI expresses all of it and refuses what cannot be."""
    v3 = MODELS["deepseek-v3"]
    h, a = 7168, 128
    mla = h * 1536 + 1536 + 1536 * a * 192 + h * 576 + 512 + 512 * a * 256 + a * 128 * h
    assert sum(v3.attn()) == mla and v3.score_dims == (192, 128)
    assert round(v3.num_params() / 1e9) == 671 and round(v3.num_params(active=True) / 1e9, 1) == 37.6
    from pdist.plan.efficiency import gemm_time, layer_time
    from pdist.plan.layout import Layout
    cfg, cl = MODELS["llama3-8b"], CLUSTERS["h100"]
    lay = Layout(cp=4, seq_len=8192)
    score = layer_time(arch_of(cfg), lay, 2048, cl)[1]
    assert score == pytest.approx(5 / 8 * 32 * 2 * gemm_time(2048, 8192, 128, cl, "mixed"))
    base = plan("gpt2-xl", "a100", dp=8, zero=2)
    off = plan("gpt2-xl", "a100", dp=8, zero=2, offload="optimizer")
    assert off["memory_per_gpu"]["optimizer"] == off["memory_per_gpu"]["grad_sum"] == 0 < base["memory_per_gpu"]["optimizer"]
    shard = arch_of(MODELS["gpt2-xl"]).num_params() / 8
    extra = (2 + 2) * shard / 25e9 + 28 * shard / 25e9           # grads down, params up (PCIe 4), CPU Adam
    assert off["waterfall"]["overhead"] - base["waterfall"]["overhead"] == pytest.approx(extra, rel=1e-3)
    inf = plan("gpt2-xl", "a100", dp=8, zero=3, offload="params")["memory_per_gpu"]
    assert inf["params"] == inf["grads"] == 0 < inf["buffers"]
    act = {pr: plan("gpt2-xl", "h100", precision=pr, recompute="selective")["memory_per_stage"][0]["activations"]
           for pr in ("mixed", "fp8")}     # FP8 inputs of QKV, proj, fc, fc2: 1 + 1 + 1 + 4 of Table 2's 34 sbh
    assert act["fp8"] == pytest.approx(act["mixed"] * 27 / 34, rel=1e-6)
    for c in ("h200", "b200", "mi300x"):
        assert plan("llama3-70b", c, dp=8, tp=8, pp=4, sp=True, zero=1, m=8)["fits"]
    assert main(["--model", "deepseek-v2", "--cluster", "h800", "--dp", "8", "--pp", "4", "--ep", "8",
                 "--zero", "1", "--m", "8", "--offload", "optimizer", "--n-shared-experts", "1", "--mla",
                 "0,512,128,64,128", "--mlp", "gelu"]) == 0
    assert "offload: optimizer to the host" in capsys.readouterr().out
    for argv, msg in ((["--zero", "1", "--offload", "params"], "it needs zero >= 3"),
                      (["--offload", "optimizer"], "it needs zero >= 1"), (["--mla", "1,2"], "five integers")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv


def test_parallel_blocks_and_sliding_windows():
    """A parallel block (one norm, attention and MLP summed: GPT-J, PaLM, Falcon) has one f and one g
    under tp: 4 all-reduce halves a layer instead of 8; a sliding window of w keys counts w per
    query in the attention's FLOPs, its score matmuls and its stored scores."""
    from dataclasses import replace
    a = arch_of(LlamaConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    par = replace(a, parallel=True)
    assert a.num_params() - par.num_params() == 2 * 32                   # one RMSNorm weight less a layer
    tp = {x.parallel: plan(x, "a100", tp=4, m=2, precision="fp32")["memory_per_stage"][0]["comm_bytes"]["tp"]
          for x in (a, par)}
    S = 1 * 64 * 32 * 4
    assert tp[False] - tp[True] == pytest.approx(2 * 2 * 4 * 3 / 4 * S)   # m 2, L 2, 4 halves, (t-1)/t
    win = replace(a, window=16)
    assert a.flops_per_token() - win.flops_per_token() == 12 * 2 * (64 - 16) * 32
    from pdist.plan.efficiency import gemm_time, layer_time
    from pdist.plan.layout import Layout
    cl = CLUSTERS["a100"]
    assert layer_time(win, Layout(), 64, cl)[1] == pytest.approx(4 * 2 * gemm_time(64, 16, 8, cl, "mixed"))
    acts = {x.window: plan(x, "a100")["memory_per_stage"][0]["activations"] for x in (a, win)}
    assert acts[0] - acts[16] == 2 * 2 * 4 * 64 * (64 - 16)            # 2 layers, 2as·keys·b bytes of scores


def test_hybrid_sharding_shards_inside_and_all_reduces_across():
    """HSDP (shard = n): ZeRO's states divide by n, not dp; the shard's gradient is all-reduced over
    the dp/n replicas, 2(R−1)/R·k_g·Ψ_pad/n bytes, priced on the replicas' (inter-node) link."""
    full, hsdp = (plan("llama3-8b", "h100", dp=32, zero=3, shard=s, m=1) for s in (0, 8))
    psi = arch_of(MODELS["llama3-8b"]).num_params()
    assert hsdp["memory_per_gpu"]["params"] == pytest.approx(2 * psi / 8, rel=1e-3)
    assert full["memory_per_gpu"]["params"] == pytest.approx(2 * psi / 32, rel=1e-3)
    sent = hsdp["memory_per_stage"][0]["comm_bytes"]
    assert sent["dp_rep"] == pytest.approx(2 * 3 / 4 * 2 * psi / 8, rel=1e-3)
    assert hsdp["links"]["dp"] == "inter-node" and full["links"]["dp"] == "inter-node"
    inside = plan("llama3-8b", "h100", dp=8, zero=3, m=1)           # one node: the same shard group alone
    assert hsdp["time_per_step"]["comm_dp"] > inside["time_per_step"]["comm_dp"]
    for bad in (dict(shard=3), dict(shard=8, zero=0)):
        with pytest.raises(ValueError, match="hybrid sharding"):
            plan("llama3-8b", "h100", dp=32, **bad)
