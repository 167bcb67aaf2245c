"""ZeRO stages 0-3 on the world (any n): equivalence, memory, communication, schedule.

For every stage (and stage 3 with and without prefetch) K AdamW steps in float64
on a small GPT are compared with single-process training on the same global
batches, shard by shard: each rank's flat shard of parameters, and of AdamW's
m and v, against the same slice of the reference (flattened and padded by the
unit's layout). Then, per rank:

* memory: the measured bytes of params / grads / optimizer state equal the
  ZeRO formula written out below, with Ψ_pad = Σ_units ceil(Ψ_u/N)·N computed
  here from the GPT's parameter shapes;
* communication: the bytes each collective sent per step equal the ring theory;
* schedule: stage 2/3 free the full gradient as units are reduced (at most the
  one in flight is left after backward); stage 3 keeps at most root + current +
  prefetched unit gathered, frees everything after backward, and its peak stays
  below formula + gathered units + gradient buffers + activations (measured as
  stage 0's peak minus stage 0's model states on this rank);
* bad input raises clear errors on every rank before any collective.
Reports one JSON object per case (pdist.testing.report); any failed assert fails the mpirun.
"""
import math
import sys

import numpy as np

from pdist import comm, data
from pdist.models import gpt
from pdist.course import lesson
from pdist.measure import memory
from pdist.parallel.zero import ZeRO
from pdist.testing import report

STEPS, B, SEED = 3, 12, 0
RTOL, ATOL = 1e-9, 1e-12

world = comm.init()
n, rank = world.size, world.rank
tokens, tok = data.char_dataset(50_000)
cfg = gpt.GPTConfig(vocab_size=tok.vocab_size, block_size=8, n_layer=2, n_head=4, n_embd=32, dtype="float64")
b = 8  # bytes per float64


def log(**kw):
    if rank == 0:
        report(n=n, **kw)


# ---- the single-process reference (params from lesson.train_reference; m, v from the same loop)
ref_losses, ref_sd = lesson.train_reference(cfg, SEED, STEPS, B, tokens)
ref_model = gpt.GPT(cfg, seed=SEED)
ref_opt = lesson.make_adamw(ref_model.parameters())
for step in range(STEPS):
    x, y = data.get_batch(tokens, B, cfg.block_size, SEED, step)
    _, loss = ref_model(x, y)
    ref_model.zero_grad()
    loss.backward()
    ref_opt.step()
named = dict(ref_model.named_parameters())
assert all(np.array_equal(ref_sd[k], named[k].data) for k in ref_sd), "reference loop != train_reference"
ref_m = {k: ref_opt.state[id(p)]["exp_avg"] for k, p in named.items()}
ref_v = {k: ref_opt.state[id(p)]["exp_avg_sq"] for k, p in named.items()}

# ---- Ψ and Ψ_pad from the GPT's shapes (independent of the engine)
shapes = cfg.param_shapes()
PSI = cfg.num_params()
unit_prefixes = [f"transformer.h.{i}." for i in range(cfg.n_layer)] + ["transformer.ln_f."]
unit_sizes = [sum(math.prod(s) for k, s in shapes.items() if k.startswith(p)) for p in unit_prefixes]
unit_sizes = [PSI - sum(unit_sizes)] + unit_sizes            # the root: wte + wpe
PSI_PAD = sum(-(-u // n) * n for u in unit_sizes)


def formula(stage):
    """ZeRO paper's model states per rank in one dtype of b bytes with Adam (m, v)."""
    P = PSI if stage == 0 else PSI_PAD
    return {0: (b * P, b * P, 2 * b * P), 1: (b * P, b * P, 2 * b * P // n),
            2: (b * P, b * P // n, 2 * b * P // n), 3: (b * P // n, b * P // n, 2 * b * P // n)}[stage]


def comm_theory(stage):
    """Bytes sent per step per op, ring accounting: all-reduce 2(n-1)/n S, RS / AG (n-1)/n S."""
    S = b * PSI_PAD
    if stage == 0:
        return {"all_reduce": sum(2 * (n - 1) * b * u / n for u in unit_sizes)}
    if stage in (1, 2):
        return {"reduce_scatter": (n - 1) * S / n, "all_gather": (n - 1) * S / n}
    return {"reduce_scatter": (n - 1) * S / n, "all_gather": 2 * (n - 1) * S / n}


def run(stage, prefetch=True):
    memory.start_tracing(restart=True)   # count this run's arrays only
    model = gpt.GPT(cfg, seed=SEED)
    z = ZeRO(model, stage, world, prefetch=prefetch)
    opt = lesson.make_adamw(z.parameters())
    gathered = []   # number of materialized units seen inside each unit's forward (stage 3)
    if stage == 3:
        for m in list(model.transformer.h) + [model.transformer.ln_f]:   # after ZeRO's own pre-hook
            m.register_forward_pre_hook(lambda mod, args: gathered.append(
                sum(u.materialized() or u.gather_work is not None for u in z.units)))
    losses, sent, peak = [], [], None
    for step in range(STEPS):
        x, y = z.local_batch(*data.get_batch(tokens, B, cfg.block_size, SEED, step))
        world.reset_stats()
        with memory.PeakMemory() as pk:
            loss = z.forward_backward(x, y)
            if stage >= 2:   # full gradients freed as units are reduced
                live = sum(u.grad_flat is not None for u in z.units)
                assert live == 0, f"stage {stage}: {live} full flat gradients alive after the step's backward"
            if stage == 3:
                assert not any(u.materialized() for u in z.units), "stage 3: a unit stayed gathered"
            opt.step()
            opt.zero_grad(set_to_none=False)
        peak = pk.peak_bytes
        sent.append({op: s["bytes"] for op, s in world.stats.items()})
        losses.append(loss)
    return z, opt, np.array(losses), sent, peak, gathered


results = {}
for stage, prefetch in [(0, True), (1, True), (2, True), (3, True), (3, False)]:
    z, opt, losses, sent, peak, gathered = run(stage, prefetch)
    name = f"stage {stage}" + ("" if prefetch else " no prefetch")
    # equivalence, shard by shard
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL, err_msg=f"{name}: loss")
    assert [u.numel for u in z.units] == unit_sizes, (name, [u.numel for u in z.units], unit_sizes)
    for u in z.units:
        st = opt.state[id(u.shard)]
        for what, got, ref in (("param", u.shard.data, ref_sd), ("exp_avg", st["exp_avg"], ref_m),
                               ("exp_avg_sq", st["exp_avg_sq"], ref_v)):
            np.testing.assert_allclose(got, u.flatten(ref)[u.lo:u.hi], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name}, rank {rank}, unit {u.name}: {what}")
    if stage in (1, 3):   # the full model (collectives; after the counted steps)
        full = z.full_state_dict()
        for k, v in ref_sd.items():
            np.testing.assert_allclose(full[k], v, rtol=RTOL, atol=ATOL, err_msg=f"{name}: full {k}")
    # memory: exactly the formula
    got = memory.model_state_bytes(z, opt)
    want = formula(stage)
    assert (got["params_bytes"], got["grads_bytes"], got["optim_bytes"]) == want, (name, got, want)
    # communication: exactly the theory, every step (stage 0 at n=3: the ring fraction is not whole;
    # the group floors each call's count, so allow < 1 byte per call)
    theory = comm_theory(stage)
    for s in sent:
        assert set(s) == set(theory), (name, s, theory)
        for op in theory:
            slack = len(z.units) if theory[op] != int(theory[op]) else 0
            assert abs(s[op] - theory[op]) <= slack, (name, op, s[op], theory[op])
    if stage == 3:
        most = 3 if prefetch else 2   # root (tied wte, needed by the head) + current (+ prefetched)
        assert max(gathered) <= most, (name, gathered)
        assert gathered.count(most) > 0, (name, "expected", most, "gathered units, saw", gathered)
    results[name] = (got, peak)
    log(case=name, model_state_bytes=sum(got.values()), formula_bytes=sum(want),
        sent_per_step=sum(sent[-1].values()), peak_bytes=peak)

# ---- stage 3's peak stays below: formula + gathered units + gradient buffers + activations
states0 = sum(results["stage 0"][0].values())
activations = results["stage 0"][1] - states0
biggest_other = max(unit_sizes[1:])
bound = (sum(formula(3)) + b * (-(-unit_sizes[0] // n) * n)          # root, gathered fwd + bwd
         + 2 * b * (-(-biggest_other // n) * n)                       # current + prefetched unit
         + 2 * b * (-(-max(unit_sizes) // n) * n)                     # flat grads: filling + in flight
         + activations)
peak3 = results["stage 3"][1]
assert peak3 <= bound, f"stage 3 peak {peak3} B exceeds the bound {bound} B"
if n >= 4:
    assert peak3 < results["stage 0"][1], (peak3, results["stage 0"][1])
log(case="stage 3 peak", peak_bytes=peak3, bound_bytes=bound, stage0_peak_bytes=results["stage 0"][1])

# ---- bad input: clear errors, raised on every rank before any collective
model = gpt.GPT(cfg, seed=SEED)
for bad, kw, words in [("stage 4", dict(stage=4), "stage must be one of"),
                       ("overlap", dict(stage=2, units=[model.transformer.h[0], model.transformer.h[0].mlp]),
                        "exactly one unit"),
                       ("foreign", dict(stage=2, units=[gpt.GPT(cfg).transformer.h[0]]), "not in the model")]:
    try:
        ZeRO(model, group=world, **kw)
    except ValueError as e:
        assert words in str(e), (bad, str(e))
    else:
        raise AssertionError(f"{bad}: no error")
log(case="bad input")
world.barrier()
sys.stdout.flush()
