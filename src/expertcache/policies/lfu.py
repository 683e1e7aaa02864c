"""Least frequently used, with aging so that old popularity fades.

Counts are kept for resident keys only (a new key starts at 1). Every
``decay`` touches (inserts plus hits) all counts are halved (rounded down), so a
key that was hot long ago cannot squat a slot forever: the "all-time LFU lost
16% to LRU" failure in the field notes. ``decay=0`` picks 8 x capacity.
Ties go to the key touched least recently. A heap with lazy deletion keeps the
victim query O(log n) amortised.
"""

from __future__ import annotations

import heapq

from .base import EvictionPolicy
from .lazy_heap import lowest_live
from .registry import register


@register
class LFU(EvictionPolicy):
    name = "lfu"
    kernel = "lfu"  # sim/kernels/lfu.py
    description = "least frequently used; all counts halve every `decay` touches (0 = 8 x capacity)"
    params = {"decay": 0}

    def __init__(self, capacity: int, decay: int = 0, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(decay, bool) or not isinstance(decay, int) or decay < 0:
            raise ValueError(f"parameter 'decay' of policy 'lfu' must be a whole number >= 0, got {decay!r}")
        self.decay = decay or 8 * capacity
        self._entry: dict[int, tuple[int, int, int]] = {}  # key -> (count, last touch, key)
        self._heap: list[tuple[int, int, int]] = []         # stale entries skipped lazily
        self._tick = 0

    def _set(self, key: int, count: int) -> None:
        entry = (count, self._tick, key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)

    def _touch(self, key: int, count: int) -> None:
        self._tick += 1
        self._set(key, count)
        if self._tick % self.decay == 0:
            self._age()

    def _age(self) -> None:
        self._entry = {k: (c >> 1, t, k) for k, (c, t, _) in self._entry.items()}
        self._heap = list(self._entry.values())
        heapq.heapify(self._heap)

    def on_insert(self, key: int, now: int) -> None:
        self._touch(key, 1)

    def on_access(self, key: int, now: int) -> None:
        self._touch(key, self._entry[key][0] + 1)

    def on_remove(self, key: int) -> None:
        del self._entry[key]

    def count(self, key: int) -> int | None:
        """The aged use count of a resident key (for tests and reports)."""
        entry = self._entry.get(key)
        return None if entry is None else entry[0]

    def victim(self, protected) -> int | None:
        return lowest_live(self._heap, self._entry, protected)
