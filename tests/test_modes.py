"""Modes applied from outside (pdist/parallel/modes.py): ``Local(model, deterministic=...)`` takes
the mode's subclass, every wrapper built around it takes its own, a strategy the mode does not
cover is refused (never silently trained without the mode), and a misspelt keyword is an error.
One process, no MPI."""
import pytest

from pdist.course import lesson
from pdist.models.gpt import GPT
from pdist.parallel import Local, MixedPrecision, modes
from pdist.parallel.base import ParallelModule
from pdist.parallel.deterministic.compute import GranuleCompute
from pdist.parallel.deterministic.strategies import Bf16Only
from pdist.engine import precision

CFG = lesson.gpt_config(64, block_size=8, n_layer=1, n_head=2, n_embd=16)


def test_local_takes_the_mode_and_keeps_its_name():
    s = Local(GPT(CFG, 0), deterministic=True)
    assert isinstance(s, GranuleCompute) and isinstance(s, Local) and type(s).__name__ == "Local"
    assert s.mode == "deterministic" and s.has_late_grads
    plain = Local(GPT(CFG, 0), deterministic=False)
    assert type(plain) is Local and plain.mode is None and not hasattr(plain, "deterministic")


def test_a_wrapper_takes_the_mode_of_what_it_wraps():
    low = precision.cast_module(GPT(CFG, 0), "bf16")
    mp = MixedPrecision(Local(low, deterministic=True), "bf16")
    assert isinstance(mp, Bf16Only) and mp.mode == "deterministic" and mp.deterministic is mp.inner.deterministic
    assert type(MixedPrecision(Local(precision.cast_module(GPT(CFG, 0), "bf16")), "bf16")) is MixedPrecision


def test_an_uncovered_strategy_and_a_misspelt_mode_are_refused():
    class Mine(ParallelModule):
        pass
    with pytest.raises(TypeError, match="Mine does not run in the deterministic mode"):
        Mine(Local(GPT(CFG, 0), deterministic=True))
    assert type(Mine(Local(GPT(CFG, 0)))) is Mine           # outside the mode: as it is
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['determinstic'\]"):
        Local(GPT(CFG, 0), determinstic=True)
    assert modes.keywords() == ["deterministic"]
