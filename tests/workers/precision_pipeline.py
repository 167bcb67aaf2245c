"""Mixed precision under pipeline and sequence parallelism equals one process in the same precision.

    mpiexec -n 2 python tests/workers/precision_pipeline.py "pp2 gpipe bf16 m4" "tp2 sp bf16"
    mpiexec -n 4 python tests/workers/precision_pipeline.py "dp2 pp2 1f1b bf16 m2" "tp2 pp2 sp 1f1b bf16 m2"

A case names its sizes (dp2 tp2 pp2, m4 micro-batches, v2 chunks, z2 for ZeRO-2), schedule,
precision and "sp".

Each case: K = 3 AdamW steps of ``parallelize(GPT, DeviceMesh(dp, tp, pp), precision=...)``
(compute in float64) against ``MixedPrecision(Local(GPT, microbatches=dp·m))`` on the same
global batches, then every piece of the masters and of Adam's m and v compared.

* pp, and dp x pp with m = 1: bit for bit. Each stage runs micro-batch j's forward and backward on
  the rows one process gives micro-batch j (activations and their gradients travel in
  float64, unrounded), rounds each weight gradient once, and sums the m of them in fp32
  in the order j = 0..m-1 (GradAccumulator); the tied wte's two parts are summed per
  micro-batch in the low dtype as one process sums them (PipelineParallel._tied_sync).
* tp, sp: the tp ranks' float64 partial sums (row-parallel outputs, column-parallel input
  gradients, sequence-parallel LayerNorm / bias / wpe gradients) add in another order:
  rtol 1e-6, atol 1e-9, as tests/workers/precision_equiv.py (a bf16 ulp is 2^-8, so this
  still fails on any extra rounding of a gradient).
* dp x pp with m > 1: each dp rank rounds its own mean over m micro-batches before the
  data-parallel mean rounds again; one process with dp·m micro-batches rounds once.
  The extra rounding moves a gradient element by at most u·Σ_r|g_r| (u the unit
  roundoff, 2^-8 bf16, 2^-11 fp16; the terms' magnitudes, not the sum's: where the
  ranks' parts nearly cancel the relative change is large, and Adam's early steps,
  ≈ lr·sign(g), can flip there). Checked over all masters: ||ΔW − ΔW_ref||₂ / ||ΔW_ref||₂
  <= 16u (ΔW = W_K − W_0; measured at K = 3: 3.5u bf16 m = 2, 3.8u bf16 m = 4, 7.7u fp16
  m = 2), and the losses to rtol 4u. Any missing or doubled reduction moves it by O(1)."""
import sys

import numpy as np

from pdist import comm, data
from pdist.course import lesson
from pdist.engine import precision
from pdist.engine.backend import set_default_dtype
from pdist.models.gpt import GPT
from pdist.engine.grad_scaler import GradScaler
from pdist.parallel import Local, MixedPrecision, parallelize
from pdist.testing import check_shards, report
from pdist.training import train

set_default_dtype("float64")
world = comm.init()
K, B, T, SEED = 3, 8, 8, 3
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
tokens, _ = data.char_dataset(50_000)
cfg = lesson.gpt_config(96, dtype="float64", block_size=T, n_layer=4, n_head=4, n_embd=32)

batch = data.batch_fn(tokens, B, T, SEED, cfg.vocab_size)


def scaler(prec):
    return GradScaler(init_scale=2.0 ** 8) if prec == "fp16" else None   # a scale that does not overflow


def parse(case):
    w = case.split()
    size = {k: int(t[len(k):]) for t in w for k in ("dp", "tp", "pp", "m", "v", "z") if t.startswith(k)
            and t[len(k):].isdigit()}
    sched = next((s for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev") if s in w), "1f1b")
    prec = next(p for p in ("bf16", "fp16") if p in w)
    return (size.get("dp", 1), size.get("tp", 1), size.get("pp", 1), size.get("m", 1), size.get("v", 1),
            sched, prec, "sp" in w, size.get("z", 0))


def run(case):
    dp, tp, pp, m, v, sched, prec, sp, zero = parse(case)
    ref = MixedPrecision(Local(precision.cast_module(GPT(cfg, SEED), prec), microbatches=dp * m), prec,
                         scaler(prec))
    w0 = {k: a.copy() for k, a in ref.full_state_dict().items()}
    ref_opt = lesson.make_adamw(ref.parameters())
    ref_losses = train(ref, ref_opt, batch, K)
    ref_sd, ref_pieces = ref.full_state_dict(), {pc.name: pc for pc in ref.pieces()}
    model = parallelize(GPT(cfg, SEED), comm.DeviceMesh(dp=dp, tp=tp, pp=pp), sequence_parallel=sp, zero_stage=zero,
                        schedule=sched, microbatches=m, chunks=v, precision=prec, scaler=scaler(prec))
    opt = lesson.make_adamw(model.parameters())
    losses = train(model, opt, batch, K)
    full = model.full_state_dict()
    if model.scaler is not None:
        assert model.scaler.state_dict() == ref.scaler.state_dict(), case
    u = UNIT_ROUNDOFF[prec]
    if dp > 1 and m > 1:                                   # another rounding grouping: a tolerance in u
        np.testing.assert_allclose(losses, ref_losses, rtol=4 * u, err_msg=case)
        num = sum(float(np.sum((full[k] - ref_sd[k]) ** 2)) for k in ref_sd)
        den = sum(float(np.sum((ref_sd[k] - w0[k]) ** 2)) for k in ref_sd)
        rel = (num / den) ** 0.5
        assert rel <= 16 * u, (case, rel, 16 * u)
        return {"case": case, "rel_update_err": rel, "u": u}
    exact = tp == 1                                      # (dp > 1 here: m = 1, the rounding of DP)

    def same(a, b):
        return np.array_equal(a, b) if exact else np.allclose(a, b, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=0, err_msg=case)
    checked = check_shards(model.sharded_state_dict(opt), ref_sd,
                           lambda name, state: ref_opt.state[id(ref_pieces[name].tensor)][state], same, (case,))
    bad = [k for k in ref_sd if not same(full[k], ref_sd[k])]
    assert not bad and checked > 0, (case, bad)
    return {"case": case, "checked": checked, "exact": exact}


report(rank=world.rank, results=[run(c) for c in sys.argv[1:]])
