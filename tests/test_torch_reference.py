"""pdist's GPT against an equivalent PyTorch GPT-2 built here, in float64:
logits, loss, every parameter gradient, and three AdamW steps.

Optional: skips when PyTorch is not installed (pip install torch)."""
import math

import numpy as np
import pytest

from pdist.course import lesson
from pdist.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=12, dtype="float64")
torch = tF = TorchGPT = None  # set by _torch, not at collection


@pytest.fixture(autouse=True, scope="module")
def _torch():
    """torch costs seconds to import: once when this module's tests run (a skip without it),
    never while pytest collects."""
    global torch, tF, TorchGPT
    torch = pytest.importorskip("torch")
    tF = torch.nn.functional
    TorchGPT = _torch_gpt(torch.nn)


def _torch_gpt(tnn):
    """The GPT-2 of pdist.models.gpt written in torch.nn (its classes need torch to be defined)."""
    class TorchBlock(tnn.Module):
        def __init__(self, C, nh):
            super().__init__()
            self.nh = nh
            self.ln_1, self.ln_2 = tnn.LayerNorm(C), tnn.LayerNorm(C)
            self.c_attn, self.attn_proj = tnn.Linear(C, 3 * C), tnn.Linear(C, C)
            self.c_fc, self.mlp_proj = tnn.Linear(C, 4 * C), tnn.Linear(4 * C, C)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.reshape(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
            att = q @ k.transpose(-2, -1) / math.sqrt(C // self.nh)
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            x = x + self.attn_proj((att @ v).transpose(1, 2).reshape(B, T, C))
            return x + self.mlp_proj(tF.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class TorchGPT(tnn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.wte = tnn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = tnn.Embedding(cfg.block_size, cfg.n_embd)
            self.h = tnn.ModuleList(TorchBlock(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
            self.ln_f = tnn.LayerNorm(cfg.n_embd)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.h:
                x = b(x)
            return self.ln_f(x) @ self.wte.weight.T  # lm_head tied to wte

        def pdist_params(self):
            """pdist name -> (torch parameter, transposed?): torch.nn.Linear stores W as (out, in),
            pdist (and Hugging Face's Conv1D) as (in, out)."""
            out = {"transformer.wte.weight": (self.wte.weight, False),
                   "transformer.wpe.weight": (self.wpe.weight, False)}
            for i, b in enumerate(self.h):
                p = f"transformer.h.{i}."
                for ours, mod in [("ln_1", b.ln_1), ("attn.c_attn", b.c_attn), ("attn.c_proj", b.attn_proj),
                                  ("ln_2", b.ln_2), ("mlp.c_fc", b.c_fc), ("mlp.c_proj", b.mlp_proj)]:
                    out[p + ours + ".weight"] = (mod.weight, isinstance(mod, tnn.Linear))
                    out[p + ours + ".bias"] = (mod.bias, False)
            out["transformer.ln_f.weight"] = (self.ln_f.weight, False)
            out["transformer.ln_f.bias"] = (self.ln_f.bias, False)
            return out

        def load_pdist(self, sd):
            with torch.no_grad():
                for name, (p, tr) in self.pdist_params().items():
                    p.copy_(torch.from_numpy(sd[name].T if tr else sd[name]))

    return TorchGPT


def perturbed_pdist_model(seed=0):
    m = GPT(CFG, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for _, p in m.named_parameters():  # biases and LayerNorms away from 0 / 1: every one matters
        p.data += 0.1 * rng.standard_normal(p.shape)
    return m


def pair(seed=0):
    m = perturbed_pdist_model(seed)
    tm = TorchGPT(CFG).double()
    tm.load_pdist(m.state_dict())
    assert set(tm.pdist_params()) == set(m.state_dict())
    return m, tm


def test_logits_loss_and_every_gradient_match_pytorch():
    m, tm = pair()
    rng = np.random.default_rng(1)
    x = rng.integers(0, CFG.vocab_size, (3, CFG.block_size))
    y = rng.integers(0, CFG.vocab_size, (3, CFG.block_size))
    logits, loss = m(x, y)
    loss.backward()
    tlogits = tm(torch.from_numpy(x))
    tloss = tF.cross_entropy(tlogits.reshape(-1, CFG.vocab_size), torch.from_numpy(y).reshape(-1))
    tloss.backward()
    np.testing.assert_allclose(logits.data, tlogits.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-12)
    params = dict(m.named_parameters())
    for name, (tp, tr) in tm.pdist_params().items():
        tg = tp.grad.numpy()
        np.testing.assert_allclose(params[name].grad, tg.T if tr else tg, rtol=1e-10, atol=1e-13,
                                   err_msg=name)


def test_shorter_sequence_and_ignore_index_match_pytorch():
    m, tm = pair(seed=2)
    rng = np.random.default_rng(3)
    x = rng.integers(0, CFG.vocab_size, (2, 5))
    y = rng.integers(0, CFG.vocab_size, (2, 5))
    y[0, :3] = -100
    logits = m(x)
    from pdist.engine import functional as F
    loss = F.cross_entropy(logits, y, ignore_index=-100)
    loss.backward()
    tloss = tF.cross_entropy(tm(torch.from_numpy(x)).reshape(-1, CFG.vocab_size),
                             torch.from_numpy(y).reshape(-1), ignore_index=-100)
    tloss.backward()
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-12)
    params = dict(m.named_parameters())
    for name, (tp, tr) in tm.pdist_params().items():
        tg = tp.grad.numpy()
        np.testing.assert_allclose(params[name].grad, tg.T if tr else tg, rtol=1e-10, atol=1e-13,
                                   err_msg=name)


def test_three_adamw_steps_match_pytorch():
    m, tm = pair(seed=4)
    opt = lesson.make_adamw(m.parameters())
    named = tm.pdist_params()
    tparams = [named[n][0] for n, _ in m.named_parameters()]
    topt = torch.optim.AdamW(tparams, lr=lesson.LR, betas=lesson.BETAS, eps=lesson.EPS,
                             weight_decay=lesson.WEIGHT_DECAY)
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
        y = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
        m.zero_grad()
        m(x, y)[1].backward()
        opt.step()
        topt.zero_grad()
        tF.cross_entropy(tm(torch.from_numpy(x)).reshape(-1, CFG.vocab_size),
                         torch.from_numpy(y).reshape(-1)).backward()
        topt.step()
    for name, p in m.named_parameters():
        tp, tr = named[name]
        t = tp.detach().numpy()
        np.testing.assert_allclose(p.data, t.T if tr else t, rtol=1e-9, atol=1e-12, err_msg=name)
