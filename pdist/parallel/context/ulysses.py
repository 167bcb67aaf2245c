"""Ulysses context parallelism (Jacobs et al., 2023, "DeepSpeed Ulysses"): an all-to-all
turns sequence sharding into head sharding around attention, and another turns it back.

Rank r holds tokens [r T/cp, (r+1) T/cp) of every head. Before attention, q, k and v each
go through one all-to-all: rank r sends heads [i H/cp, (i+1) H/cp) of its tokens to rank i,
and receives its own heads of every rank's tokens, in rank (= position) order:

    (B, T/cp, H hs)  --all_to_all-->  (B, T, H/cp hs)

Attention then runs on whole sequences of H/cp heads (pdist.engine.attention, unchanged),
and a fourth all-to-all brings the output (B, T, n_head/cp hs) back to (B, T/cp, n_head hs).
Backward is the same four all-to-alls, inverted. Each moves (cp - 1)/cp of its array
(``ulysses_bytes``). Query head h reads kv head h // g, so rank i's query heads find their
kv heads on rank i when n_head and n_kv_head both divide by cp (else: refused).
"""
from pdist.engine import attention
from pdist.engine.attention import _split
from pdist.engine.autograd import Function
from pdist.engine.backend import xp


def _exchange(x, group, to_heads):
    """One all-to-all. to_heads: (B, Tl, w) -> (B, cp Tl, w/cp); else the inverse."""
    n = group.size
    if to_heads:
        B, Tl, w = x.shape
        send = xp.ascontiguousarray(x.reshape(B, Tl, n, w // n).transpose(2, 0, 1, 3))  # (cp, B, Tl, w/cp)
    else:
        B, T, w = x.shape
        send = xp.ascontiguousarray(x.reshape(B, n, T // n, w).transpose(1, 0, 2, 3))  # (cp, B, T/cp, w)
    recv = xp.empty_like(send)
    group.all_to_all(recv, send)
    if to_heads:
        return recv.transpose(1, 0, 2, 3).reshape(B, n * Tl, w // n)  # chunk j: rank j's tokens
    return recv.transpose(1, 2, 0, 3).reshape(B, T // n, n * w)  # chunk i: rank i's heads


class SeqToHeads(Function):
    """x (B, T/cp, sum(parts)) [part | part | ..] -> (B, T, sum(parts)/cp), one all-to-all per
    part (a fused [Q | K | V] keeps its layout: each part's heads are cut apart)."""
    fresh_grads = True

    def forward(self, x, group, parts, to_heads=True):
        self.group, self.parts, self.to_heads = group, parts, to_heads
        out, off = [], 0
        for p in parts:
            out.append(_exchange(x[..., off:off + p], group, to_heads))
            off += p
        return out[0] if len(out) == 1 else xp.concatenate(out, axis=-1)

    def backward(self, grad):
        n, out, off = self.group.size, [], 0
        for p in self.parts:
            w = p // n if self.to_heads else p * n
            out.append(_exchange(grad[..., off:off + w], self.group, not self.to_heads))
            off += w
        return (out[0] if len(out) == 1 else xp.concatenate(out, axis=-1)),


def check_heads(n_head, n_kv_head, cp, where="attention"):
    """Ulysses splits heads over cp: n_head and n_kv_head must divide by cp."""
    for name, v in (("n_head", n_head), ("n_kv_head", n_kv_head)):
        if v % cp:
            raise ValueError(f"Ulysses context parallelism over cp = {cp}: {where} has {name} = {v}, not "
                             f"divisible by {cp}. Choose cp dividing both n_head and n_kv_head, or use "
                             f"context_parallel='ring'")


def ulysses_attention(*tensors, n_head, n_kv_head=None, group):
    """Causal attention of this rank's T/cp tokens by heads: a fused qkv (B, T/cp,
    (n_head + 2 n_kv_head) hs) or q, k, v -> (B, T/cp, n_head hs)."""
    n, n_kv = group.size, n_kv_head or n_head
    check_heads(n_head, n_kv, n)
    if len(tensors) == 1:
        q, k, _ = _split([tensors[0].data], n_head, n_kv)
        qkv = SeqToHeads.apply(tensors[0], group=group, parts=(q.shape[-1], k.shape[-1], k.shape[-1]))
        y = attention.CausalAttention.apply(qkv, n_head=n_head // n, n_kv_head=n_kv // n)
    else:
        q, k, v = (SeqToHeads.apply(t, group=group, parts=(t.shape[-1],)) for t in tensors)
        y = attention.causal_attention(q, k, v, n_head // n, n_kv // n)  # (B, T, n_head/cp hs)
    return SeqToHeads.apply(y, group=group, parts=(y.shape[-1],), to_heads=False)


def ulysses_bytes(B, T, cp, n_head, n_kv_head, head_size, itemsize):
    """(forward, backward) bytes each rank sends per attention layer: four all-to-alls (q, k,
    v and the output), each (cp - 1)/cp of its (B, T/cp, width) array."""
    per = B * (T // cp) * (2 * n_head + 2 * n_kv_head) * head_size * itemsize
    return (cp - 1) * per // cp, (cp - 1) * per // cp


__all__ = ["ulysses_attention", "SeqToHeads", "check_heads", "ulysses_bytes"]
