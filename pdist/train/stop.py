"""Ctrl-C and SIGTERM during ``python -m pdist.train``: every rank stops after the same step.

A signal lands on the ranks at different points: one in a collective, another in its backward.
A rank that raised at once and left would strand its peers in the collective it never joined. So
the first SIGINT or SIGTERM only sets a flag (the step goes on, its collectives complete); after
each step the ranks take the max of their flags (one 8-byte all-reduce on a private copy of the
world) and, when any rank was signalled, all of them stop there together, with nothing written
half-way (a save in progress completes first) and a clean exit. A second signal hands over to the
handler that was there before (pdist/comm/failures.py: abort the job at once).
"""
import signal

import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_GROUPS = {}        # world -> its private copy, kept to the process's end (below)


class Stop(Exception):
    """Raised by ``Stopper.check`` on every rank at once: the run was interrupted."""

    def __init__(self, name):
        super().__init__(name)
        self.name = name


class Stopper:
    def __init__(self, world):
        self.group = _group(world)
        self.got, self.prev = None, {}

    def __enter__(self):
        for sig in SIGNALS:
            try:
                self.prev[sig] = signal.signal(sig, self._on)
            except ValueError:             # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, *exc):
        for sig, prev in self.prev.items():
            signal.signal(sig, prev)
        self.prev = {}

    def _on(self, signum, frame):
        if self.got is None:
            self.got = signal.Signals(signum).name
            return
        prev = self.prev.get(signum)       # the second one: as before this run
        self.__exit__()
        if callable(prev):
            prev(signum, frame)
        raise KeyboardInterrupt

    def check(self):
        """Collective (every rank, after every step): raise Stop on every rank when any was signalled."""
        flag = np.array([0.0 if self.got is None else float(SIGNALS.index(signal.Signals[self.got]) + 1)])
        if self.group is not None:
            self.group.all_reduce(flag, op="max")
        if flag[0]:
            raise Stop(SIGNALS[int(flag[0]) - 1].name)


def _group(world):
    """The world's private copy for the stop flag, made once (collective) and kept: the run's last
    collective is on it, and a rank's exit announcement names the last call on each group it still
    holds (pdist/comm/watchdog.py), so a peer still finishing that call knows it was completed."""
    if world.size == 1:
        return None
    if id(world) not in _GROUPS:
        _GROUPS[id(world)] = world.split(0, name="train.stop")
    return _GROUPS[id(world)]
