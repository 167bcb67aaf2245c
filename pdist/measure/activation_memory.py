"""Activation memory of a transformer block: the paper's formula, pdist's own, and a measurement.

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer
Models") count, per layer, with s tokens per sequence, b sequences, h the
width, a heads, 16-bit activations and 1-byte dropout masks:

    none        sbh (34 + 5 as/h)  bytes
    selective   sbh  34            bytes   (QK^T, softmax, its dropout, x V recomputed)
    full        2 sbh              bytes   (only the block's input)

pdist re-derived (e bytes per element, N = sb tokens, no dropout in a block). An array
stays alive while the graph references it: a Function's saved arrays, *and* every
input tensor of a recorded node (``ctx.parents``), so an op's output lives as long as
its consumer's node. Per block, counting its input and not its output:

    x (the input)                      N h        held by ln_1 and the residual add
    ln_1: x_hat, output; rstd          2 N h + N
    c_attn output qkv                  3 N h      q, k, v are views of it
    P = softmax(q k^T / sqrt(d) + M)   a s'^2 b   saved by the fused attention (pdist/engine/attention.py)
    the attention's output (B, T, C)   N h        c_proj's parent
    c_proj output; x + attn            2 N h
    ln_2: x_hat, output; rstd          2 N h + N
    c_fc output; gelu's t; gelu output 12 N h
    mlp c_proj output                  N h        (the block's output x + mlp: the next block's)

    none        e (24 sbh + as'^2 b + 2 sb)
    selective   e (24 sbh + 2 sb)   the core's input qkv and output kept; P recomputed
    full        e sbh               the input only

The paper's 34 (in 2-byte units: 17 elements) against pdist's 24 elements: pdist keeps
no dropout masks, but keeps both LayerNorm's x_hat and its output and GELU's tanh; its
fused attention keeps P alone (no scores beside it: the paper's as^2 b terms are P, its
dropout mask and the dropout's output, 5 bytes; pdist's is P, e bytes). And pdist keeps only
the causal blocks of P (``attention.saved_scores``): s'^2 = s^2 up to 64 tokens, about
s^2 (n + 1) / 2n for n blocks of 64 (5/8 s^2 at s = 256); on a device, s^2.

``measure_block`` walks the graph from a block's output back to its input and sums the
unique buffers it holds (arrays saved on nodes and the data of every tensor reached,
each base buffer once, parameters and their views excluded).
"""
from pdist.engine.attention import saved_scores
from pdist.engine.autograd import Tensor


def layer_activations(s, b, h, a, t=1, sp=False, recompute="none"):
    """Bytes of one layer's stored activations for one micro-batch, Korthikanti et al. 2022,
    Table 2 (16-bit activations, 1-byte dropout masks), t-way tensor parallel (``sp``: with
    sequence parallelism); the planner's formula too (pdist/plan/model.py imports it from here)."""
    if recompute == "full":
        return 2 * s * b * h
    attn = 0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + attn)


def paper_bytes(cfg, batch, mode):
    """Korthikanti et al.'s bytes per layer (16-bit activations, dropout masks;
    ``layer_activations`` with t = 1)."""
    return layer_activations(cfg.block_size, batch, cfg.n_embd, cfg.n_head, recompute=mode)


def formula_bytes(cfg, batch, mode, itemsize, seq=None):
    """pdist's bytes per block for (cfg, batch rows, seq tokens), derived in the docstring."""
    s, b, h, a = seq or cfg.block_size, batch, cfg.n_embd, cfg.n_head
    elems = {"none": 24 * s * b * h + a * saved_scores(s) * b + 2 * s * b,
             "selective": 24 * s * b * h + 2 * s * b, "full": s * b * h}[mode]
    return elems * itemsize


def _base(a):
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def _arrays(obj):
    """The arrays a node keeps in its attributes (directly or in tuples/lists)."""
    for v in vars(obj).values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(x, "nbytes") and hasattr(x, "dtype"):
                yield x


def graph_buffers(root, stop=(), exclude=()):
    """{id: buffer} of every base buffer the graph behind ``root`` keeps alive, walking back
    through ``ctx.parents`` and stopping at the tensors in ``stop`` (their data counted)
    and at leaves (not counted). ``root``'s own data is not counted; the buffers of
    ``exclude`` (parameters) and anything viewing them are left out."""
    skip = {id(_base(t.data)) for t in exclude}
    stops = {id(t) for t in stop}
    found, seen, todo = {}, {id(root)}, [root]

    def add(a):
        base = _base(a)
        if id(base) not in skip:
            found[id(base)] = base

    while todo:
        t = todo.pop()
        if t is not root:
            add(t.data)
        if id(t) in stops or t._ctx is None:
            continue
        for a in _arrays(t._ctx):
            add(a)
        for p in t._ctx.parents:
            if isinstance(p, Tensor) and id(p) not in seen and (p._ctx is not None or id(p) in stops):
                seen.add(id(p))
                todo.append(p)
    found.pop(id(_base(root.data)), None)
    return found


def measure_block(block, x, params=None):
    """Bytes the graph of ``block(x)`` keeps alive (its input counted, its output not)."""
    out = block(x)
    bufs = graph_buffers(out, stop=[x], exclude=params if params is not None else block.parameters())
    return sum(b.nbytes for b in bufs.values()), out


def table(cfg, batch, itemsize, measured):
    """Rows (mode, paper bytes, pdist formula bytes, measured bytes) for ``measured`` {mode: bytes}."""
    return [(m, paper_bytes(cfg, batch, m), formula_bytes(cfg, batch, m, itemsize), measured[m])
            for m in measured]
