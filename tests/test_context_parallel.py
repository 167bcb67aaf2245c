"""Context parallelism (ring attention, zigzag, Ulysses) equals one process, and its bytes and
work equal the formulas.

tests/workers/context_parallel.py runs every case of one world size in one launch: the
attention ops against pdist.engine.attention on the whole sequence (y, dQ, dK, dV shard by
shard; bytes and message counts exactly), the planted stale-K/V backward (must fail),
AdamW training of GPT-2 and Llama under ``parallelize(..., context_parallel=)`` against one
process (float64, rtol 1e-9, every piece of every parameter and Adam state; B/dp rows and
T/cp tokens per rank), the mesh's rank order, and the refusals."""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdist.models.llama import LlamaConfig
from pdist.parallel.context import check_context
from pdist.parallel.context.zigzag import attention_work, block_pairs, positions, segments
from pdist.testing import mpirun, reports
from shared_launch import chosen, own, world

W = "tests/workers/context_parallel.py"
MEMORY_CP2 = 108032     # a GPT block's activation bytes per rank at cp 2 (B 4, T 16, C 16, float64)


def _cases(out):
    return {(r["case"], r.get("model"), r.get("kind", r.get("mode")), r.get("layout"), r.get("dp"), r.get("zero"),
             r.get("fused")) for r in reports(out)}


def test_cp2_ring_zigzag_ulysses_gpt_and_llama_equal_one_process():
    out = mpirun(2, W, timeout=120)
    rs = reports(out)
    assert sum(r["case"] == "train" for r in rs) == 2 * 7, out[-3000:]  # 2 models x 3 modes, + recompute & micro-batches
    assert sum(r["recompute"] == "selective" and r["microbatches"] == 2 for r in rs if r["case"] == "train") == 2
    assert sum(r["case"] == "op" for r in rs) == 2 * 6, out[-3000:]
    stale = [r for r in rs if r["case"] == "stale"]
    assert len(stale) == 2 and all(r["forward_equal"] and not r["grads_equal"] and not r["training_equal"]
                                   for r in stale), stale
    assert sum(r["case"] == "refused" for r in rs) == 2
    assert {r["bytes"] for r in rs if r["case"] == "memory"} == {MEMORY_CP2}     # worker: = the T/cp formula


def test_cp2_on_device_arrays_standin():
    """The same launch on device arrays (tests/strict_cupy, NCCL transport): ring's sends and
    receives go out in one group call, else NCCL's blocking p2p would hang the ring."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PDIST_DEVICE="gpu", PDIST_GPU_TRANSPORT="nccl", STRICT_CUPY_LAZY="1",
               PYTHONPATH=os.pathsep.join([str(root / "tests" / "strict_cupy"), os.environ.get("PYTHONPATH", "")]))
    rs = reports(mpirun(2, W, env=env, timeout=120))
    assert sum(r["case"] == "train" for r in rs) == 2 * 7 and sum(r["case"] == "op" for r in rs) == 2 * 6, rs


def suite_jobs(n, names):
    """This module's jobs at 4 and 8 ranks, for ``world`` (tests/shared_launch.py), each
    named after its test (tests/workers/jobs.py); the 2-rank ones have their own (the stand-in's
    environment, and ring attention's 2-rank cases alone)."""
    return chosen({"test_cp4_and_cp2_dp2_and_zero_equal_one_process": (4, [W]),
                   "test_cp_composes_with_tp_sp_pp_zero_and_low_precision_at_4": (4, [C]),
                   "test_cp_composes_at_8_ranks": (8, [C])}, names, n)


def test_cp4_and_cp2_dp2_and_zero_equal_one_process(request):
    rs = own(request, world(4, request))
    train = [r for r in rs if r["case"] == "train"]
    got = {(r["model"], r["mode"], r["dp"], r["cp"], r["zero"]) for r in train}
    assert got == {("gpt2", "ring-zigzag", 2, 2, 0), ("llama", "ulysses", 2, 2, 0), ("gpt2", "ring", 2, 2, 1),
                   ("llama", "ring", 2, 2, 3),
                   ("gpt2", "ring", 1, 4, 0), ("llama", "ring-zigzag", 1, 4, 0), ("gpt2", "ulysses", 1, 4, 0)}, got
    assert len(train) == 4 * 7
    ops = [r for r in rs if r["case"] == "op"]
    assert len(ops) == 4 * 5
    assert {r["bytes"] for r in rs if r["case"] == "memory"} == {MEMORY_CP2 // 2}  # activations ∝ T/cp
    work = {lay: sorted(r["work"] for r in ops if r["kind"] == "ring" and r["layout"] == lay and r["fused"])
            for lay in ("contiguous", "zigzag")}           # measured by the op, per rank, T = 16, cp = 4
    assert work == {"contiguous": [16, 32, 48, 64], "zigzag": [36, 36, 36, 36]}, work


C = "tests/workers/cp_compose.py"


def _layouts(rs, n):
    """{(model, mode, dp, cp, tp, pp, sp, zero, schedule, precision)} reported by all n ranks
    (reports ``rs``), each rank at its own mesh coordinates, with the bytes of the formula every step."""
    train = [r for r in rs if r["case"] == "train"]
    got = {}
    for r in train:
        assert r["bytes"] == [r["want_bytes"]] * 2 and r["pieces"] > 0, r   # = ring_bytes / ulysses_bytes
        key = (r["model"], r["mode"], r["dp"], r["cp"], r["tp"], r["pp"], r["sp"], r["zero"], r["schedule"],
               r["precision"])
        got.setdefault(key, set()).add(tuple(r["coords"]))
    assert all(len(c) == n for c in got.values()), got
    return set(got)


def test_cp_composes_with_tp_sp_pp_zero_and_low_precision_at_4(request):
    """One launch: cp2 x tp2 (ring, zigzag, Ulysses; with and without SP), cp2 x pp2 under every
    schedule (1f1b, gpipe, interleaved, zb-h1, zb-v, dualpipev), cp2 x dp2 ZeRO-1/2/3, GPT and
    Llama, equal to one process (float64, rtol 1e-9, every piece); bf16 and fp16 to the
    rounding (the worker's docstring says which claim); the refusals on every rank; a checkpoint
    saved at cp2 x tp2 resumes at cp2 x dp2 ZeRO-3 and at one process, equal to the run."""
    rs = own(request, world(4, request))
    got = _layouts(rs, 4)
    tp = {(m, mode, 1, 2, 2, 1, sp, 0, "1f1b", "fp32") for m, mode, sp in (
        ("gpt2", "ring", False), ("llama", "ring", True), ("gpt2", "ring-zigzag", True),
        ("llama", "ring-zigzag", False), ("gpt2", "ulysses", True), ("llama", "ulysses", False))}
    pp = {(m, mode, 1, 2, 1, 2, False, 0, s, "fp32") for m, mode, s in (
        ("gpt2", "ring", "1f1b"), ("llama", "ring-zigzag", "gpipe"), ("gpt2", "ulysses", "interleaved"),
        ("llama", "ring", "zb-h1"), ("gpt2", "ring-zigzag", "zb-v"), ("llama", "ulysses", "dualpipev"))}
    zero = {("llama", "ring-zigzag", 2, 2, 1, 1, False, 2, "1f1b", "fp32"),      # (ZeRO-1, ring ZeRO-3:
            ("gpt2", "ulysses", 2, 2, 1, 1, False, 3, "1f1b", "fp32")}            # the test above)
    low = {("gpt2", "ring-zigzag", 2, 2, 1, 1, False, 1, "1f1b", "bf16"), ("llama", "ring", 1, 2, 2, 1, True, 0,
                                                                          "1f1b", "fp16")}
    hsdp = {("gpt2", "ring", 2, 2, 1, 1, False, 2, "1f1b", "fp32")}       # 2 replicas x (1 x cp2) shards
    assert got == tp | pp | zero | low | hsdp, got ^ (tp | pp | zero | low | hsdp)
    _hsdp(rs, shard_group=2)
    msgs = [r["message"] for r in rs if r["case"] == "refused"]
    assert len(msgs) == 2 * 4 and sum("per tp rank" in m for m in msgs) == 4, msgs
    ckpt = [(r["layout"], r["step"]) for r in rs if r["case"] == "checkpoint"]    # saved at cp2 x tp2
    assert sorted(ckpt) == sorted([("cp2 x dp2, ulysses, zero 3", 2), ("one process", 2)] * 4), ckpt


def test_cp_composes_at_8_ranks(request):
    """cp2 x dp2 x tp2 (zigzag +SP ZeRO-1, GPT; Ulysses ZeRO-3, Llama), cp2 x tp2 x pp2 (ring +SP,
    Llama), cp4 x tp2 (zigzag +SP, GPT): every rank's pieces equal one process's, the bytes the
    formula's."""
    got = _layouts(own(request, world(8, request)), 8)
    assert got == {("gpt2", "ring-zigzag", 2, 2, 2, 1, True, 1, "1f1b", "fp32"),
                   ("llama", "ulysses", 2, 2, 2, 1, False, 3, "1f1b", "fp32"),
                   ("llama", "ring", 1, 2, 2, 2, True, 0, "1f1b", "fp32"),
                   ("gpt2", "ring-zigzag", 1, 4, 2, 1, True, 0, "1f1b", "fp32"),
                   ("llama", "ulysses", 4, 2, 1, 1, False, 3, "1f1b", "fp32")}, got      # HSDP 2 x (2 x cp2)
    _hsdp(own(request, world(8, request)), shard_group=4)


def _hsdp(rs, shard_group):
    """The HSDP case (rep 2) ran as HSDP over dp_shard x cp ranks on every rank."""
    hs = [r for r in rs if r["case"] == "train" and r["rep"] == 2]
    assert hs and all(r["chain"][1] == "HSDP" and r["shard_group"] == shard_group for r in hs), hs


def test_zigzag_balances_the_causal_work():
    """Per-rank attention work (score elements computed, the masked diagonal chunk counted
    whole): contiguous chunks of c = T/cp, rank r computes r + 1 chunk pairs, the last rank
    cp times the first; zigzag (chunks of c' = T/2cp), every rank 2 cp + 1 pairs."""
    T, cp = 64, 4
    plain, zig = attention_work(T, cp), attention_work(T, cp, "zigzag")
    c, c2 = T // cp, T // (2 * cp)
    assert plain == [(r + 1) * c * c for r in range(cp)] and max(plain) == cp * min(plain), plain
    assert zig == [(2 * cp + 1) * c2 * c2] * cp, zig


def test_segments_positions_and_errors():
    assert segments(16, 2, 0, "zigzag") == [(0, 4), (12, 16)] and segments(16, 2, 1, "zigzag") == [(4, 8), (8, 12)]
    assert sorted(x for r in range(4) for x in positions(16, 4, r, "zigzag")) == list(range(16))
    with pytest.raises(ValueError, match="divisible by 8"):
        segments(12, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        segments(16, 2, 0, "striped")
    assert [d for _, _, d in block_pairs([(0, 4)], [(0, 4)])] == [True] and block_pairs([(0, 4)], [(4, 8)]) == []


@pytest.mark.parametrize("kw, needle", [
    (dict(mode=None, cp=2), "context_parallel='ring'"),
    (dict(mode="rings", cp=2), "must be one of"),
    (dict(mode="ring", cp=2, dropout=0.1), "dropout = 0"),
    (dict(mode="ulysses", cp=2, tp=2, n_kv_head=2), "n_kv_head = 2 gives 1 heads per tp rank"),
    (dict(mode="ulysses", cp=4, tp=1, n_kv_head=2), "not divisible by cp = 4"),
])
def test_check_context_refuses_clearly(kw, needle):
    """Refused before any collective: what cannot compose. (tp, pp, every schedule, ZeRO and
    bf16/fp16 compose: tests/workers/cp_compose.py.)"""
    mesh = SimpleNamespace(cp_world_size=kw.pop("cp"), tp_world_size=kw.pop("tp", 1), pp_world_size=1)
    dropout = kw.pop("dropout", 0.0)
    cfg = SimpleNamespace(dropout=dropout) if dropout else LlamaConfig(
        vocab_size=96, block_size=16, n_head=8, n_kv_head=kw.pop("n_kv_head", 8), n_embd=32)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        check_context(cfg, mesh, **kw)
