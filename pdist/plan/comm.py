"""Bytes each group sends per step, and their time by α–β over the links the group crosses.

Ring accounting (docs/design.md; lesson 06 counts the same), per GPU of one pipeline rank, k_a
bytes per activation element, S = b·(s/cp)·h·k_a one micro-batch's hidden states:

    dp   ZeRO 0: all-reduce 2(N−1)/N·k_g·Ψ_r, one per DDP bucket (25 MiB, the first 1 MiB); 1, 2: reduce-scatter (k_g) + all-gather (k_p) of
         Ψ_pad, (N−1)/N each; 3: (2m·k_p + k_g)(N−1)/N·Ψ_pad. N = dp·cp for dense units
         (pdist's DDP/ZeRO span dp × cp), dp·cp/ep for the routed experts (the edp group)
    tp   Megatron's 4 all-reduces (SP: 4 all-gathers + 4 reduce-scatters) per layer and
         micro-batch, 8·(t−1)/t·S (+4 with full recompute), embedding and head 2 each, the
         loss's 3 scalars per token (2 all-reduces: max, then the packed sums), SP's partial gradients of the unsplit weights
    pp   one activation S (÷t with SP) forward and one gradient back per chunk boundary
         (bytes sent; steps: each rank's sends and receives)
    cp   ring (Liu et al. 2023): K and V blocks passed cp−1 times forward, K, V and their
         gradients twice back: 3·(cp−1)·2·b·(s/cp)·a_kv·d·k_a per layer; Ulysses (Jacobs et al.
         2023): all-to-alls of q, k, v, out forward and back, 2·(2h + 2·a_kv·d)·b·(s/cp)·k_a·(cp−1)/cp
    dp_rep  HSDP (``shard``): ZeRO's collectives inside the shard group of n ranks, then each gradient
         shard all-reduced over the R = dp·cp/n replicas, 2(R−1)/R·k_g·Ψ_pad/n, on that group's link
    ep   per MoE layer 4 all-to-alls (dispatch, combine; forward and back) of
         tokens·k·h·k_a·(ep−1)/ep, tokens = b·s/cp (GShard; issue 26's count)

A collective costs steps·α + bytes/β on the link it crosses (β per GPU per direction, the rate
nccl-tests' busbw reports).
"""
from pdist.plan.layout import V_SHAPED, crosses, strides
from pdist.plan.presets import BYTES

GROUPS = ("tp", "cp", "ep", "pp", "dp")
BUCKET_CAP, FIRST_BUCKET_CAP = 25 * 2 ** 20, 2 ** 20     # DataParallel's bucket_cap_mb=25, first_bucket_cap_mb=1


def _pad(units, n):
    return sum(-(-u // n) * n for u in units)


def buckets(units, nbytes, cap=BUCKET_CAP, first_cap=FIRST_BUCKET_CAP):
    """How many all-reduces pdist's DDP issues (pdist/parallel/data_parallel.build_buckets):
    the units walked in reverse fill buckets of at most ``cap`` bytes, the first of at most
    ``first_cap``; a unit is split across buckets at the cap (pdist splits at its tensors)."""
    n = size = cur = 0
    for u in reversed(units):
        left = u * nbytes
        while left > 0:
            if n == 0 or size >= cur:
                n, size = n + 1, 0
                cur = first_cap if n == 1 else cap
            take = min(left, cur - size)
            size, left = size + take, left - take
    return n


def _dp_bytes(units, n, lay, kp, kg):
    if n <= 1 or not units:
        return 0.0, 0
    psi, pad = sum(units), _pad(units, n)
    b = {0: 2 * kg * psi, 1: (kg + kp) * pad, 2: (kg + kp) * pad, 3: (2 * lay.m * kp + kg) * pad}[lay.zero]
    per = buckets(units, kp) if lay.zero == 0 else len(units) * (2 if lay.zero < 3 else 2 * lay.m + 1)
    calls = per * (2 if lay.zero == 0 else 1) * (n - 1)
    return b * (n - 1) / n, calls


def group_bytes(a, lay, dense, experts, layers, ks, pp_rank):
    """({group: bytes sent per step}, {group: collective steps per step}) of one GPU."""
    kp, kg, _, ka = BYTES[lay.precision]
    kg = lay.grad_bytes(kg)
    t, m, cp, ep, V = lay.tp, lay.m, lay.cp, lay.ep, lay.pp * lay.v
    n = lay.zero_n
    sent, calls = {g: 0.0 for g in GROUPS}, {g: 0 for g in GROUPS}
    for us, N in ((dense, n), (experts, n // ep)):
        b, c = _dp_bytes(us, N, lay, kp, kg)
        sent["dp"] += b
        calls["dp"] += c
    R = lay.dp * cp // n
    if R > 1 and dense:                # HSDP: the gradient shard all-reduced across the R replicas
        sent["dp_rep"] = 2 * (R - 1) / R * kg * _pad(dense, n) / n
        calls["dp_rep"] = 2 * (R - 1) * len(dense)
    s, C, b = (lay.seq_len or a.seq) // cp, a.h, lay.micro_batch
    first, last, L = 0 in ks, V - 1 in ks, len(layers)
    hops = sum((k < V - 1) + (k > 0) for k in ks) - 2 * (lay.schedule in V_SHAPED and pp_rank == lay.pp - 1)
    sent["pp"] = float(m * b * s // (t if lay.sp else 1) * C * ka * hops)   # the V's turn is a local copy
    calls["pp"] = 2 * m * hops                  # each boundary: m sends and m receives on this rank
    if t > 1:
        S, ring = b * s * C * ka, (t - 1) / t
        per_layer = (8 + 4 * (lay.recompute == "full")) // (2 if a.parallel else 1)   # a parallel block: one f, one g
        per_mb = (per_layer * L + 2 * first + 2 * last) * ring * S + last * 2 * ring * 3 * b * s * ka
        sent["tp"] = m * per_mb
        if lay.sp:
            unsplit = a.attn()[1] + a.mlp(a.ffn)[1] + a.norms()
            sent["tp"] += 2 * ring * (L * unsplit + a.final_norm() * last + (s * C if a.learned_pos else 0) * first) * kp
        calls["tp"] = m * (per_layer * L + 2 * first + 2 * last + 4 * last) * (t - 1)   # loss: 2 all-reduces
    kvd = a.n_kv_head * a.head_dim // t
    if cp > 1 and lay.cp_mode == "ring":
        sent["cp"] = m * L * 3 * (cp - 1) * 2 * b * s * kvd * ka
        calls["cp"] = m * L * 3 * (cp - 1)
    elif cp > 1:
        sent["cp"] = m * L * 2 * (2 * C // t + 2 * kvd) * b * s * ka * (cp - 1) / cp
        calls["cp"] = m * L * 8 * (cp - 1)
    moe = sum(1 for i in layers if a.moe and i >= a.n_dense)
    if ep > 1 and moe:
        sent["ep"] = m * moe * 4 * b * s * a.top_k * C * ka * (ep - 1) / ep
        calls["ep"] = m * moe * 4 * (ep - 1)
    return sent, calls


def links(lay, gpus_per_node):
    """{group: True when it crosses nodes}, in the rank order of pdist.plan.layout.strides."""
    return {g: crosses(st, size, gpus_per_node) for g, (st, size) in strides(lay).items()}


def comm_time(sent, calls, link_of):
    """Seconds per group: steps·α + bytes/β on its link (``link_of(group)`` -> Link)."""
    return {g: calls[g] * link_of(g).alpha + sent[g] / link_of(g).beta for g in GROUPS}
