"""Central finite differences for gradient tests (float64).

    grads_match(lambda a, b: (a * b).sum(), [a_array, b_array])

``fn`` takes Tensors and returns a Tensor of any shape; the check contracts it
with a fixed random cotangent R (L = sum(fn(...) * R)) so that every output
element carries a different weight, runs backward once, and compares each
input's .grad with (L(x + h e_i) - L(x - h e_i)) / 2h, element by element.
Inputs may be non-contiguous views (transposed, strided slices): the check
perturbs them in place, through the view, so fn always sees the same layout.
"""
import numpy as np

import pdist
from pdist import Tensor
from pdist.engine.gradcheck import central_difference


def _loss(out, R):
    return float(np.sum(pdist.to_numpy(out.data) * R))


def numeric_grads(fn, arrays, R, h=1e-6):
    grads = []
    for a in arrays:
        g = np.zeros(a.shape)
        for idx in np.ndindex(*a.shape):
            g[idx] = central_difference(lambda: _loss(fn(*[Tensor(x) for x in arrays]), R), a, idx, h)
        grads.append(g)
    return grads


def analytic_grads(fn, arrays, R):
    ts = [Tensor(x, requires_grad=True) for x in arrays]
    out = fn(*ts)
    (out * Tensor(R)).sum().backward() if out.ndim else (out * float(R)).backward()
    return [t.grad for t in ts], out


def grads_match(fn, arrays, seed=0, rtol=1e-6, atol=1e-8, h=1e-6):
    """Assert analytic == numeric gradients for every input; returns the analytic ones."""
    for a in arrays:
        assert a.dtype == np.float64, "finite differences need float64 inputs"
    out = fn(*[Tensor(x) for x in arrays])
    R = np.random.default_rng(seed + 12345).standard_normal(out.shape)
    ana, _ = analytic_grads(fn, arrays, R)
    num = numeric_grads(fn, arrays, R, h=h)
    for i, (ga, gn) in enumerate(zip(ana, num)):
        assert ga is not None, f"input {i} got no gradient"
        assert ga.shape == gn.shape, f"input {i}: grad shape {ga.shape} != input shape {gn.shape}"
        np.testing.assert_allclose(ga, gn, rtol=rtol, atol=atol, err_msg=f"gradient of input {i}")
    return ana
