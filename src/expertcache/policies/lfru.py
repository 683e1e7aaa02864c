"""LFRU: frequency and recency in one decaying score (the LRFU family).

Each resident key carries ``score = sum over its uses of 2 ** -(age / halflife)``,
age counted in touches (inserts plus hits) of this policy. A large halflife
makes it LFU, a small one LRU; in between, a burst of uses long ago is worth
less than a few recent ones. The victim is the lowest score.

Because every score decays by the same factor, ``log2(score) + last / halflife``
(``last`` = the key's latest touch) orders keys exactly as their current scores
do and never changes while the key is idle: a heap with lazy deletion serves
the victim query. ``halflife=0`` picks the capacity (a key must be reused about
once per cache turnover to stay).
"""

from __future__ import annotations

import heapq
import math

from .base import EvictionPolicy
from .lazy_heap import lowest_live
from .registry import register


@register
class LFRU(EvictionPolicy):
    name = "lfru"
    description = "frequency-recency: lowest exponentially decayed use count (`halflife` touches, 0 = capacity)"
    params = {"halflife": 0.0}

    def __init__(self, capacity: int, halflife: float = 0.0, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(halflife, bool) or not isinstance(halflife, (int, float)) or not halflife >= 0:
            raise ValueError(f"parameter 'halflife' of policy 'lfru' must be a number >= 0, got {halflife!r}")
        self.halflife = float(halflife or capacity)
        self._state: dict[int, tuple[float, int]] = {}  # key -> (score at last touch, last touch)
        self._entry: dict[int, tuple[float, int, int]] = {}  # key -> live heap entry
        self._heap: list[tuple[float, int, int]] = []  # (priority, last touch, key)
        self._tick = 0

    def _touch(self, key: int, score: float) -> None:
        self._tick += 1
        self._state[key] = (score, self._tick)
        entry = (math.log2(score) + self._tick / self.halflife, self._tick, key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)

    def score(self, key: int) -> float | None:
        """A resident key's decayed score as of now (for tests and reports)."""
        state = self._state.get(key)
        if state is None:
            return None
        return state[0] * 2.0 ** (-(self._tick - state[1]) / self.halflife)

    def on_insert(self, key: int, now: int) -> None:
        self._touch(key, 1.0)

    def on_access(self, key: int, now: int) -> None:
        score, last = self._state[key]
        # Decay to this touch's tick (one more than the current), then count this use.
        self._touch(key, score * 2.0 ** (-(self._tick + 1 - last) / self.halflife) + 1.0)

    def on_remove(self, key: int) -> None:
        del self._state[key]
        del self._entry[key]

    def victim(self, protected) -> int | None:
        return lowest_live(self._heap, self._entry, protected)
