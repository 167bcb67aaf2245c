"""Modes: a concern applied to a whole chain of strategies from outside, never a branch inside one.

A strategy file holds its algorithm only. A mode that changes how strategies compute (how a
step sums its gradients, which kernels run) is a *layer*: for every strategy class it
changes, it registers a mixin, and a chain built in the mode is made of the strategies'
classes with those mixins in front, as torchtitan applies each concern in its own
``apply_*`` pass and PyTorch FSDP2's ``fully_shard`` gives a module a subclass of its class:

    register("name", {Local: ComputeMixin, DataParallel: JoinMixin, ...})
    Local(model, name=arg)        # an instance of (ComputeMixin, Local) when arg turns the mode on
    DataParallel(that, group)     # built around a strategy in the mode: (JoinMixin, DataParallel)

``Local`` takes the mode's keyword; every wrapper takes the mode of the strategy it wraps
(``Strategy.mode``), so ``parallelize`` and a chain built by hand agree. A class the mode did
not register (nor any base of it) is refused with a TypeError naming the class and the mode:
a strategy that does not know the mode would train silently wrong. The subclasses are
made once per class and keep the class's name, so messages and ``isinstance`` read as before.
"""
_modes = {}            # keyword -> (on(arg) -> bool, {strategy class: mixin})
_made = {}             # (mode, class) -> the class with the mode's mixin in front


def register(keyword, mixins, on=lambda arg: arg is not None and arg is not False):
    """Register a mode turned on by ``Local(..., keyword=arg)`` when ``on(arg)``; ``mixins``: for
    each strategy class it changes (or only carries on to the next wrapper), the mixin put in
    front of it."""
    _modes[keyword] = (on, dict(mixins))
    for key in [k for k in _made if k[0] == keyword]:
        del _made[key]


def keywords():
    """The registered modes' keywords (``Local`` accepts each)."""
    return sorted(_modes)


def mode_of(kw):
    """The one mode that ``Local``'s keyword arguments ``kw`` turn on, or None. An unknown
    keyword raises TypeError, as an unexpected keyword argument does."""
    unknown = sorted(set(kw) - set(_modes))
    if unknown:
        raise TypeError(f"Local() got unexpected keyword argument(s) {unknown}; the modes it takes: {keywords()}")
    on = [k for k, arg in kw.items() if _modes[k][0](arg)]
    if len(on) > 1:
        raise ValueError(f"Local(): modes {on} at once; a chain runs in one mode")
    return on[0] if on else None


def in_mode(cls, mode):
    """``cls``, or, when ``mode`` is a registered mode, ``cls`` with the mode's mixin in front."""
    if mode is None:
        return cls
    key = (mode, cls)
    if key not in _made:
        mixins = _modes[mode][1]
        base = next((c for c in cls.__mro__ if c in mixins), None)
        if base is None:
            raise TypeError(f"{cls.__name__} does not run in the {mode} mode (it covers "
                            f"{sorted(c.__name__ for c in mixins)}); build the chain without {mode}=, or "
                            f"register a mixin for {cls.__name__} (pdist/parallel/modes.py)")
        if getattr(cls, "mode", None) == mode:
            _made[key] = cls                          # made in the mode already
        else:
            _made[key] = type(cls.__name__, (mixins[base], cls), {"__module__": cls.__module__,
                                                                  "__qualname__": cls.__qualname__, "mode": mode})
    return _made[key]


def inner_of(args, kw):
    """The strategy (or module) a wrapper is built around: its first argument."""
    if args:
        return args[0]
    return next((kw[k] for k in ("inner", "module", "model") if k in kw), None)


__all__ = ["register", "keywords", "mode_of", "in_mode", "inner_of"]
