"""Admission policies: should a missed key take a slot, or be served as a bypass?"""

from __future__ import annotations

from collections import OrderedDict, deque

from .base import AdmissionPolicy
from .registry import register


@register
class Always(AdmissionPolicy):
    name = "always"
    kernel = 0  # the code sim/kernels/skeleton.py compiles in (ALWAYS)
    description = "admit every missed key (plain demand caching)"
    records = False

    def admit(self, candidate: int, victim: int | None) -> bool:
        return True


@register
class Never(AdmissionPolicy):
    name = "never"
    description = "admit nothing: every miss is a bypass (llama.cpp's copy-every-pass)"
    records = False

    def admit(self, candidate: int, victim: int | None) -> bool:
        return False


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
        self.ghost_size = ghost
        # Recently seen keys, oldest first. Hits are recorded too (the table calls record
        # for every access), so a key evicted soon after a hit is readmitted at once.
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._seen_before = False

    def record(self, key: int, now: int) -> None:
        # Remember whether this key was seen before this access, then note it.
        self._seen_before = key in self._ghost
        if self._seen_before:
            self._ghost.move_to_end(key)
        else:
            self._ghost[key] = None
            if len(self._ghost) > self.ghost_size:
                self._ghost.popitem(last=False)

    def admit(self, candidate: int, victim: int | None) -> bool:
        return victim is None or self._seen_before


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
        self._uses: dict[int, deque[int]] = {}
        self._count = 0

    def record(self, key: int, now: int) -> None:
        uses = self._uses.get(key)
        if uses is None:
            uses = self._uses[key] = deque()
        uses.append(now)
        while uses and uses[0] <= now - self.w:
            uses.popleft()
        self._count = len(uses)

    def admit(self, candidate: int, victim: int | None) -> bool:
        return victim is None or self._count >= self.n
