"""Memory per GPU of one pipeline rank: model states, activations, and what frameworks add.

Model states (Rajbhandari et al. 2020, §5; lesson 03 measures them) with k_p, k_g, k_o bytes
per element (presets.BYTES; mixed 2 + 2 + 12) and N the ranks a unit is sharded over (dp·cp
for dense units; dp·cp/ep for the routed experts, which ep already split):

    stage 0: k_p·Ψ_r     + k_g·Ψ_r      + k_o·Ψ_r
    stage 1: k_p·Ψ_pad   + k_g·Ψ_pad    + k_o·Ψ_pad/N
    stage 2: k_p·Ψ_pad   + k_g·Ψ_pad/N  + k_o·Ψ_pad/N      (m = 1, or DeepSpeed at any m)
             k_p·Ψ_pad   + k_g·Ψ_pad(1 + 1/N) + k_o·Ψ_pad/N   pdist at m > 1: the full gradient is
                                         kept across the micro-batches (FSDP's no_sync), then its shard
    stage 3: k_p·Ψ_pad/N + k_g·Ψ_pad/N  + k_o·Ψ_pad/N

DeepSpeed's estimator (deepspeed.runtime.zero: estimate_zero2/3_model_states_mem_needs, no
offload) counts 4Ψ + 16Ψ/N at ZeRO-2 (the full 16-bit gradient) and 4·largest layer + 18Ψ/N at
ZeRO-3 (no 16-bit gradient shard): ``accounting="deepspeed"`` counts the same.

Ψ_r: this GPU's units (the root: embeddings on the first stage, the head, or the tied wte's
copy, on the last; each block; the final norm), tensor-parallel tensors divided by t
(lesson 06). Ψ_pad = Σ_units ⌈Ψ_u/N⌉·N (docs/zero.md). Beyond the paper, by ``accounting``:

    grad_sum     mixed precision, gradients not already fp32: an fp32 copy of the optimizer's
                 gradient (4·Ψ/N at stages 1-3): pdist's MixedPrecision W.grad, DeepSpeed's fp32
                 partition (its estimator's 16Ψ/N). Not in "paper" nor "megatron" (whose
                 ``--grad-dtype`` fp32 main grads take the gradients' place: k_g = 4).
    logits       the last stage's fp32 logits and their gradient, 2·4·b·s·V/t
    temporaries  one layer's activations beside the stash (the layer being back-propagated or
                 recomputed), and ZeRO-3's gathered + prefetched unit, 2·k_p·max Ψ_u ("buffers")
    held         pdist only: what ZeRO's buffer pool keeps beyond ``buffers`` between steps (``pool_bytes``:
                 two full gradients per unit size at stages 2-3, two gathered units per size at stage 3)
    baseline     the process before the model: interpreter, libraries, pdist (``this``: measured; 0 on GPUs)
    reserve      the cluster's reserve (CUDA context, NCCL, the allocator's cache) + 5% fragmentation
    offload      ZeRO-Offload (Ren et al. 2021): optimizer and grad_sum on the host (0 here); ZeRO-Infinity
                 (Rajbhandari et al. 2021): the param and gradient shards too, only ZeRO-3's buffers stay

"paper" counts the paper's states + activations + ZeRO-3's buffers only. Activations per layer
per micro-batch: Korthikanti et al. 2022, Table 2 (``layer_activations``, which the measurement
shares: pdist/measure/activation_memory.py), generalized in ``arch_activations`` to GQA, SwiGLU,
experts and context parallelism, times the stash.
"""
import math
from dataclasses import replace

from pdist.plan.layout import spans, stash, virtual_stages
from pdist.plan.presets import BYTES

FRAGMENTATION = 0.05


def stage_units(a, lay, r):
    """(dense units, expert units, layers, virtual stages) of one GPU of pipeline rank r: element
    counts per ZeRO unit (one tp shard, E/ep experts)."""
    V, t = lay.pp * lay.v, lay.tp
    ks = virtual_stages(lay, r)
    runs = spans(a.n_layer, V)
    layers = [i for k in ks for i in range(*runs[k])]
    emb, head = a.embeddings(t)
    first, last = 0 in ks, V - 1 in ks
    root = (emb if first else 0) + (head if last else 0) + (a.vocab * a.h // t if last and a.tied and not first else 0)
    dense = [root] + [a.block(i, t, lay.ep) - a.expert_elements(i, t, lay.ep) for i in layers]
    experts = [a.expert_elements(i, t, lay.ep) for i in layers if a.expert_elements(i, t, lay.ep)]
    if last:
        dense.append(a.final_norm())
    return dense, experts, layers, ks


def _pad(units, n):
    return sum(-(-u // n) * n for u in units)


def _zero2_grads(lay, pad, N):
    """ZeRO-2's gradient elements: pdist at m > 1 keeps the full gradient and then its shard;
    DeepSpeed's estimator counts the full 16-bit gradient at any m; the paper, the shard."""
    if lay.accounting == "deepspeed":
        return pad
    return pad * (1 + 1 / N) if lay.m > 1 and lay.accounting == "pdist" else pad / N


def model_states(units, lay, n=None, experts=()):
    """(params, grads, optimizer, grad_sum) bytes per GPU, the formulas above; ``n``: dp·cp."""
    kp, kg, ko, _ = BYTES[lay.precision]
    kg = lay.grad_bytes(kg)
    out = [0, 0, 0, 0]
    n = n or lay.zero_n
    for us, N in ((units, n), (experts, max(1, n // lay.ep))):
        if not us:
            continue
        psi, pad = sum(us), _pad(us, N)
        p, g, o = {0: (psi, psi, psi), 1: (pad, pad, pad / N), 2: (pad, _zero2_grads(lay, pad, N), pad / N),
                   3: (pad / N, 0 if lay.accounting == "deepspeed" else pad / N, pad / N)}[lay.zero]
        out[0] += kp * p
        out[1] += kg * g
        out[2] += ko * o
        if lay.precision in ("mixed", "fp8") and kg != 4 and lay.accounting in ("pdist", "deepspeed"):
            out[3] += 4 * o
    if lay.offload != "none":           # ZeRO-Offload: fp32 masters, Adam and fp32 grads live on the host;
        out[2] = out[3] = 0             # ZeRO-Infinity: the param and grad shards too (the gather buffers stay)
        if lay.offload == "params":
            out[0] = out[1] = 0
    return tuple(round(x) for x in out)


def arch_activations(a, lay, s, moe_layer=False):
    """Bytes (2-byte units) of one layer's activations per micro-batch, Table 2's terms per
    tensor: unsplit 4sbh (two norms' inputs) + 2sbh + 2sbh (the attention's and the MLP's inputs)
    + 2sbh of dropout masks; split by t: Q 2sbh, K and V 4sbh·a_kv/a, the projection's input 2sbh,
    the MLP's 2sb·f per GELU tensor (2: input, output) or SwiGLU tensor (3: gate, up, product);
    scores 5as²b (2as²b without dropout), none under selective recompute (FlashAttention keeps
    none either). An MoE layer holds k·c copies of a token's MLP tensors (+ its input, permuted)
    and the shared experts'. Context parallelism: s is this rank's s/cp. GPT-2 gives Table 2. FP8
    keeps the GEMMs' saved inputs (attention's, MLP's, projection's, down's) in 1 byte, not 2."""
    b, h, t, sp = lay.micro_batch, a.h, lay.tp, lay.sp and lay.tp > 1
    sbh = s * b * h
    if lay.recompute == "full":
        return 2 * sbh
    kvr = a.n_kv_head / a.n_head
    per_f = (6 if a.gated else 4) / h          # bytes per f per sbh
    mlp = per_f * a.ffn
    if moe_layer:
        mlp = a.top_k * (a.capacity or 1.0) * (2 + per_f * a.expert_ffn) + a.n_shared * per_f * a.expert_ffn
    split = 2 + 4 * kvr + 2 + mlp
    unsplit = (4 if a.parallel else 8) + (2 if a.dropout_masks else 0)     # a parallel block: one norm, one input
    if lay.precision == "fp8":      # the GEMMs' saved inputs in FP8, 1 byte (Transformer Engine; DeepSeek-V3 §3.3)
        down = (a.top_k * (a.capacity or 1.0) * (2 + 2 * a.expert_ffn / h) + a.n_shared * 2 * a.expert_ffn / h
                if moe_layer else 2 * a.ffn / h)
        unsplit -= 1 if a.parallel else 2                                  # the attention's and the MLP's inputs
        split -= (2 + down) / 2                                            # the projection's and down's inputs
    keys = min(s, a.window) if a.window else s
    scores = 0 if lay.recompute == "selective" or lay.attention == "flash" else (5 if a.dropout_masks else 2) * a.n_head * keys / h
    return sbh * ((unsplit + split) / t + scores / t if sp else unsplit + split / t + scores / t)


def activations(a, lay, layers, s):
    """Bytes of a stage's stored activations (stash excluded) and of its largest layer (no recompute)."""
    ka = BYTES[lay.precision][3]
    per = [arch_activations(a, lay, s, a.moe and i >= a.n_dense) * ka / 2 for i in layers]
    plain = replace(lay, recompute="none" if lay.recompute == "full" else lay.recompute)
    big = max((arch_activations(a, plain, s, a.moe and i >= a.n_dense) * ka / 2 for i in layers), default=0)
    return sum(per), big


def pool_bytes(units, lay, n):
    """What pdist's ZeRO buffer pool (host_memory.BufferPool, pdist/parallel/zero/flat_param.py) keeps
    between steps: per distinct padded unit size, the full gradients (stages 2, 3) and gathered params
    (stage 3) it handed out, two of a size at once (the one in use and the one in flight or prefetched).
    Measured at m = 1 (tests/workers/zero_rss.py). ZeRO-2 at m > 1 keeps every full gradient to the
    step's end: those are already in "grads", and the pool's buffers are the same ones (none added)."""
    if lay.zero < 2 or n <= 1 or lay.accounting != "pdist":
        return 0
    kp, kg = BYTES[lay.precision][0], lay.grad_bytes(BYTES[lay.precision][1])
    sizes = {}
    for u in units:
        pad = -(-u // n) * n
        sizes[pad] = sizes.get(pad, 0) + 1
    grads = 0 if lay.zero == 2 and lay.m > 1 else sum(size * min(c, 2) for size, c in sizes.items())
    params = sum(size * min(c, 2) for size, c in sizes.items()) if lay.zero == 3 else 0
    return kg * grads + kp * params


def stage_memory(a, lay, r, cluster):
    """Memory of one GPU of pipeline rank r: bytes by category, "total", and "fits"'s input."""
    dense, experts, layers, ks = stage_units(a, lay, r)
    s = (lay.seq_len or a.seq) // lay.cp
    p_, g_, o_, gs = model_states(dense, lay, experts=experts)
    acts, big = activations(a, lay, layers, s)
    kp = BYTES[lay.precision][0]
    n = lay.zero_n
    mem = {"params": p_, "grads": g_, "optimizer": o_, "grad_sum": gs, "activations": round(acts * stash(lay, r)),
           "buffers": 2 * max(dense + experts) * kp if lay.zero == 3 and n > 1 else 0,
           "logits": 0, "temporaries": 0, "held": 0, "baseline": 0, "reserve": 0}
    if lay.accounting != "paper":
        last = lay.pp * lay.v - 1 in ks
        mem["logits"] = 2 * 4 * lay.micro_batch * s * math.ceil(a.vocab / lay.tp) if last else 0
        mem["temporaries"] = round(big)
        mem["held"] = max(0, pool_bytes(dense, lay, n) + pool_bytes(experts, lay, max(1, n // lay.ep)) -
                          mem["buffers"])
        mem["baseline"] = round(cluster.baseline)
        held = sum(mem.values())
        mem["reserve"] = round(cluster.reserve + FRAGMENTATION * held)
    mem["total"] = sum(mem.values())
    return mem, dense, experts, layers, ks
