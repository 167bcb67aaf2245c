"""Each tensor-parallel layer against the single-process layer, on the world group (t ranks):
output, input gradient, weight-shard gradient and bias gradient equal the matching slices of
the single-process values (float64, rtol 1e-9) at sizes 13*t and 17*t; the collectives each
layer issues in forward and backward are counted exactly; bad sizes raise on every rank
before any collective.

The reference is computed on every rank with the plain ops (F.linear, F.embedding,
F.cross_entropy) on the full arrays; each rank's loss is sum(Y_local * R_local) for a fixed
random R, so the sum of the ranks' losses is the single-process loss sum(Y * R)."""
import numpy as np

from pdist import Tensor, comm
from pdist.engine import functional as F
from pdist.engine.backend import set_default_dtype, to_numpy
from pdist.models.gpt import GPTConfig
from pdist.testing import report
from pdist.models import gpt
from pdist.parallel import TensorParallel
from pdist.parallel.tensor import layers as tp

set_default_dtype("float64")
world = comm.init()
t, r = world.size, world.rank
RTOL, ATOL = 1e-9, 1e-12
B, T = 2, 2 * t  # T divides by t for the sequence-parallel cases
IN, OUT, V = 13 * t, 17 * t, 17 * t
rng = np.random.default_rng(1234)  # same draws on every rank
X = rng.standard_normal((B, T, IN))
W, b = rng.standard_normal((IN, OUT)), rng.standard_normal(OUT)
R = rng.standard_normal((B, T, OUT))
checked = []


def close(got, ref, what):
    got = to_numpy(got.numpy() if hasattr(got, "numpy") else got)  # device arrays: explicit copies
    ref = to_numpy(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
    err = np.max(np.abs(got - ref)) if got.size else 0.0
    assert np.allclose(got, ref, rtol=RTOL, atol=ATOL), f"{what}: max abs err {err:.3e}"
    checked.append(what)


def calls():
    return {op: s["calls"] for op, s in world.stats.items()}


def seq(a):  # this rank's tokens of a (B, T, ...) array
    return tp.partition(a, 1, r, t)


def cols(a, stride=1):  # this rank's last-axis block
    return tp.partition(a, -1, r, t, stride)


def reference_linear(x, w, bias, r_out):
    xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    bt = Tensor(bias, requires_grad=True)
    y = F.linear(xt, wt, bt)
    (y * Tensor(r_out)).sum().backward()
    return y.numpy(), xt.grad, wt.grad, bt.grad


def run(layer, x, r_local, fwd_calls, bwd_calls, what):
    """forward, loss = sum(y * r_local), backward; checks the exact collective counts."""
    xt = Tensor(x, requires_grad=True)
    world.reset_stats()
    y = layer(xt)
    assert calls() == (fwd_calls if t > 1 else {}), f"{what} forward issued {calls()}, expected {fwd_calls}"
    world.reset_stats()
    (y * Tensor(r_local)).sum().backward()
    assert calls() == (bwd_calls if t > 1 else {}), f"{what} backward issued {calls()}, expected {bwd_calls}"
    return y, xt.grad


# --- ColumnParallelLinear: Y_i = X A_i + b_i ------------------------------------------------
Y, dX, dW, db = reference_linear(X, W, b, R)
for gather in (True, False):
    layer = tp.ColumnParallelLinear(IN, OUT, gather_output=gather, group=world, master_weight=W,
                                    master_bias=b)
    what = f"ColumnParallelLinear(gather_output={gather})"
    y, gx = run(layer, X, R if gather else cols(R), {"all_gather": 1} if gather else {},
                {"all_reduce": 1}, what)
    close(y, Y if gather else cols(Y), what + " output")
    close(gx, dX, what + " dX")
    close(layer.weight.grad, cols(dW), what + " dW shard")
    close(layer.bias.grad, cols(db), what + " db shard")

# fused [Q | K | V] columns (stride 3): the shard takes its columns of each third
W3, b3 = rng.standard_normal((IN, 3 * OUT)), rng.standard_normal(3 * OUT)
R3 = rng.standard_normal((B, T, 3 * OUT))
Y3, dX3, dW3, db3 = reference_linear(X, W3, b3, R3)
layer = tp.ColumnParallelLinear(IN, 3 * OUT, gather_output=False, group=world, stride=3, master_weight=W3,
                                master_bias=b3)
y, gx = run(layer, X, cols(R3, 3), {}, {"all_reduce": 1}, "ColumnParallelLinear(stride=3)")
close(y, cols(Y3, 3), "stride-3 output")
close(gx, dX3, "stride-3 dX")
close(layer.weight.grad, cols(dW3, 3), "stride-3 dW shard")
close(layer.bias.grad, cols(db3, 3), "stride-3 db shard")

# sequence parallel: input (B, T/t, in) all-gathered; backward reduce-scatters dX
layer = tp.ColumnParallelLinear(IN, OUT, gather_output=False, group=world, sequence_parallel=True,
                                master_weight=W, master_bias=b)
y, gx = run(layer, seq(X), cols(R), {"all_gather": 1}, {"reduce_scatter": 1}, "ColumnParallelLinear(SP)")
close(y, cols(Y), "ColumnParallelLinear(SP) output")
close(gx, seq(dX), "ColumnParallelLinear(SP) dX shard")
close(layer.weight.grad, cols(dW), "ColumnParallelLinear(SP) dW shard")

# --- RowParallelLinear: Y = sum_i X_i A_i + b ------------------------------------------------
for parallel_in in (True, False):
    layer = tp.RowParallelLinear(IN, OUT, input_is_parallel=parallel_in, group=world, master_weight=W,
                                 master_bias=b)
    what = f"RowParallelLinear(input_is_parallel={parallel_in})"
    y, gx = run(layer, cols(X) if parallel_in else X, R, {"all_reduce": 1},
                {} if parallel_in else {"all_gather": 1}, what)
    close(y, Y, what + " output")
    close(gx, cols(dX) if parallel_in else dX, what + " dX")
    close(layer.weight.grad, tp.partition(dW, 0, r, t), what + " dW shard")
    close(layer.bias.grad, db, what + " db (replicated, added once)")

layer = tp.RowParallelLinear(IN, OUT, input_is_parallel=True, group=world, sequence_parallel=True,
                             master_weight=W, master_bias=b)
y, gx = run(layer, cols(X), seq(R), {"reduce_scatter": 1}, {"all_gather": 1}, "RowParallelLinear(SP)")
close(y, seq(Y), "RowParallelLinear(SP) output shard")
close(gx, cols(dX), "RowParallelLinear(SP) dX")
close(layer.weight.grad, tp.partition(dW, 0, r, t), "RowParallelLinear(SP) dW shard")
gb = layer.bias.grad.copy()
world.all_reduce(gb)  # partial over this rank's tokens until summed (Korthikanti et al.)
close(gb, db, "RowParallelLinear(SP) db after the all-reduce")

# --- VocabParallelEmbedding ---------------------------------------------------------------------
E = rng.standard_normal((V, IN))
idx = rng.integers(0, V, (B, T))
idx[0, :2] = [0, V - 1]  # first and last rows
RE = rng.standard_normal((B, T, IN))
Et = Tensor(E, requires_grad=True)
YE = F.embedding(idx, Et)
(YE * Tensor(RE)).sum().backward()
for sp in (False, True):
    emb = tp.VocabParallelEmbedding(V, IN, group=world, sequence_parallel=sp, master_weight=E)
    what = f"VocabParallelEmbedding(sequence_parallel={sp})"
    world.reset_stats()
    y = emb(idx)
    assert calls() == ({"reduce_scatter" if sp else "all_reduce": 1} if t > 1 else {}), f"{what}: {calls()}"
    world.reset_stats()
    (y * Tensor(seq(RE) if sp else RE)).sum().backward()
    assert calls() == ({"all_gather": 1} if sp and t > 1 else {}), f"{what} backward: {calls()}"
    close(y, seq(YE.numpy()) if sp else YE.numpy(), what + " output")
    close(emb.weight.grad, tp.partition(Et.grad, 0, r, t), what + " dW rows")

# --- vocab-parallel cross-entropy: no rank holds the full logits -------------------------------
Z = rng.standard_normal((B, T, V)) * 3
tgt = rng.integers(0, V, (B, T))
tgt[0, :t] = np.arange(t) * (V // t)  # a target in every rank's slice
Zt = Tensor(Z, requires_grad=True)
L = F.cross_entropy(Zt, tgt)
L.backward()
zl = Tensor(cols(Z), requires_grad=True)
world.reset_stats()
loss = tp.vocab_parallel_cross_entropy(zl, tgt, group=world)
assert calls() == ({"all_reduce": 2} if t > 1 else {}), f"vocab CE forward: {calls()} (max, sums)"
world.reset_stats()
loss.backward()
assert calls() == {}, f"vocab CE backward must be local, issued {calls()}"
close(np.asarray(loss.item()), np.asarray(L.item()), "vocab-parallel CE loss")
close(zl.grad, cols(Zt.grad), "vocab-parallel CE dlogits slice")

# --- the sequence scatter region (forward own tokens, backward all-gather) ------------------------
xt = Tensor(X, requires_grad=True)
ys = tp.scatter_to_sequence_parallel_region(xt, world)
(ys * Tensor(seq(X))).sum().backward()
close(ys, seq(X), "scatter_to_sequence_parallel_region output")
close(xt.grad, X, "scatter_to_sequence_parallel_region dX (all-gathered)")

# --- bad sizes: the same clear error on every rank, before any collective ----------------------
def expect_error(make, words, what):
    world.reset_stats()
    try:
        make()
    except (ValueError, IndexError) as e:
        msg = str(e)
        assert all(w in msg for w in words), f"{what}: message lacks {words}: {msg}"
    else:
        if t > 1:
            raise AssertionError(f"{what}: no error at t={t}")
    assert world.stats == {}, f"{what}: a collective ran before the error: {world.stats}"
    checked.append("error: " + what)


if t > 1:
    odd = 13 * t + 1
    expect_error(lambda: tp.ColumnParallelLinear(IN, odd, group=world), ["out_features", str(odd), str(t)],
                 "column out_features")
    expect_error(lambda: tp.RowParallelLinear(odd, OUT, group=world), ["in_features", str(odd)],
                 "row in_features")
    expect_error(lambda: tp.VocabParallelEmbedding(odd, IN, group=world), ["vocabulary", "Pad"], "vocab")
    expect_error(lambda: tp.RowParallelLinear(IN, OUT, group=world, sequence_parallel=True),
                 ["input_is_parallel=True"], "row SP without parallel input")
    expect_error(lambda: TensorParallel(gpt.GPT(GPTConfig(vocab_size=96, n_head=t + 1, n_embd=4 * (t + 1))),
                                        world),
                 ["n_head = %d" % (t + 1), "divisible by %d" % t], "GPT n_head")
    expect_error(lambda: TensorParallel(gpt.GPT(GPTConfig(vocab_size=97, n_head=4, n_embd=16)), world),
                 ["vocab_size = 97", "Pad the vocabulary"], "GPT vocab")
    small = GPTConfig(vocab_size=96, block_size=16, n_head=4, n_embd=16, dtype="float64")
    sp_model = TensorParallel(gpt.GPT(small), world, sequence_parallel=True)
    expect_error(lambda: sp_model.local_batch(*(np.zeros((1, 2 * t + 1), dtype=np.int64),) * 2),
                 ["sequence length", str(2 * t + 1)],
                 "SP sequence length")
    expect_error(lambda: sp_model(np.full((1, 2 * t), 96)), ["out of range"], "embedding id out of range")
world.barrier()  # every rank got here: nobody hung in a collective

report(rank=r, t=t, checks=len(checked))
