"""cupy.random: a Generator whose draws are device arrays (its own stream of numbers,
like CuPy's, so a caller that wants NumPy's masks must draw them with NumPy)."""
import numpy as _np

import cupy as _cp


class Generator:
    def __init__(self, seed=None):
        self._g = _np.random.default_rng(None if seed is None else [int(seed), 0xC0FFEE])

    def __getattr__(self, name):
        fn = getattr(self._g, name)

        def draw(*a, **k):
            return _cp._wrap(fn(*_cp._unwrap(a), **k))
        return draw


def default_rng(seed=None):
    return Generator(seed)
