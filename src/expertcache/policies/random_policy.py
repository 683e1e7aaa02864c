"""Random eviction, seeded: a baseline every smarter policy must beat.

``victim`` must be a pure query, so the random draw is taken when the state
changes (an insert or a removal), never while answering: asking twice gives the
same key, and asking with other protected sets changes nothing.
"""

from __future__ import annotations

import random

from .base import EvictionPolicy
from .registry import register


@register
class RandomEviction(EvictionPolicy):
    name = "random"
    description = "evict a uniformly random resident key (seeded, reproducible)"
    params = {"seed": 0}

    def __init__(self, capacity: int, seed: int = 0, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"parameter 'seed' of policy 'random' must be a whole number >= 0, got {seed!r}")
        self._rng = random.Random(seed)
        self._keys: list[int] = []        # resident keys, in no particular order
        self._index: dict[int, int] = {}  # key -> its position in _keys (O(1) removal)
        self._draw = self._rng.random()   # where the next victim search starts, in [0, 1)

    def on_insert(self, key: int, now: int) -> None:
        self._index[key] = len(self._keys)
        self._keys.append(key)
        self._draw = self._rng.random()

    def on_access(self, key: int, now: int) -> None:
        pass

    def on_remove(self, key: int) -> None:
        i = self._index.pop(key)
        last = self._keys.pop()
        if last != key:  # swap the last key into the hole
            self._keys[i] = last
            self._index[last] = i
        self._draw = self._rng.random()

    def victim(self, protected) -> int | None:
        keys = self._keys
        n = len(keys)
        start = int(self._draw * n)
        # Walk from the drawn position; protected keys (a step's own) are skipped.
        for i in range(n):
            key = keys[(start + i) % n]
            if key not in protected:
                return key
        return None
