"""Admission policies: should a missed key take a slot, or be served as a bypass?

The built-in rules are compiled, written once in ``policies/kernels/skeleton.py``
(``admission``) and run by both ``SlotTable`` and the simulator; a class here holds its
name, parameters and their checks, and in ``kernel`` the rule's code there.
"""

from __future__ import annotations

from .base import AdmissionPolicy
from .registry import register


@register
class Always(AdmissionPolicy):
    name = "always"
    kernel = 0  # ALWAYS in policies/kernels/skeleton.py
    description = "admit every missed key (plain demand caching)"
    records = False


@register
class Never(AdmissionPolicy):
    name = "never"
    kernel = 3  # NEVER
    description = "admit nothing: every miss is a bypass (llama.cpp's copy-every-pass)"
    records = False


@register
class SecondHit(AdmissionPolicy):
    name = "second-hit"
    kernel = 1  # SECOND_HIT
    description = ("admit a key seen before (still in a bounded ghost list of `ghost` recent keys); "
                   "free slots take anything")
    params = {"ghost": 4096}

    def __init__(self, ghost: int = 4096) -> None:
        if ghost < 1:
            raise ValueError("parameter 'ghost' of policy 'second-hit' must be at least 1")
        # Hits are recorded too (every access is), so a key evicted soon after a hit is
        # readmitted at once.
        self.ghost = ghost


@register
class Window(AdmissionPolicy):
    name = "window"
    kernel = 2  # WINDOW
    description = ("admit a key used at least `n` times (this use included) within its layer's last "
                   "`w` steps; free slots take anything")
    params = {"n": 2, "w": 16}

    def __init__(self, n: int = 2, w: int = 16) -> None:
        if n < 1 or w < 1:
            raise ValueError("parameters 'n' and 'w' of policy 'window' must be at least 1")
        self.n, self.w = n, w


@register
class Oracle(AdmissionPolicy):
    name = "oracle"
    kernel = 4  # ORACLE
    description = ("offline: admit a miss only if the victim's next use is later than the key's "
                   "(belady+oracle = MIN with bypass, the true optimum); replays only")
    records = False
    needs_future = compares_victim = True


@register
class Freq(AdmissionPolicy):
    name = "freq"
    kernel = 5  # FREQ
    description = ("TinyLFU-style: in a step of more than `narrow` keys (a batch; 0: top-k), admit a "
                   "miss only if its key was used more often than the victim (counts halve every "
                   "`reset` accesses); free slots take anything")
    params = {"reset": 65536, "narrow": 0}
    compares_victim = True

    def __init__(self, reset: int = 65536, narrow: int = 0) -> None:
        if reset < 1:
            raise ValueError("parameter 'reset' of policy 'freq' must be at least 1")
        self.reset, self.narrow = reset, narrow
