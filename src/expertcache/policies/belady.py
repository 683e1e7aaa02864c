"""Belady's MIN: evict the key whose next use is farthest in the future.

The offline optimum under forced admission (every miss is cached). It needs
the whole future, so it works only in replays of a known trace; a table that
uses it without ``bind_future`` refuses to step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from .base import EvictionPolicy
from .lazy_heap import lowest_live
from .registry import register

NEVER = 1 << 62  # "not used again": later than any step


class Future:
    """Next-use lookups over a known sequence of steps.

    ``steps[s]`` lists the keys step ``s`` uses; the table's clock ``now`` is the
    step index. Queries must come with non-decreasing ``now`` (a replay), which
    makes each lookup amortised O(1).
    """

    def __init__(self, steps: Iterable[Sequence[int]]) -> None:
        uses: dict[int, list[int]] = {}
        for s, keys in enumerate(steps):
            for key in keys:
                lst = uses.get(key)
                if lst is None:
                    uses[key] = [s]
                elif lst[-1] != s:
                    lst.append(s)
        self._uses = uses
        self._pos = dict.fromkeys(uses, 0)

    def next_use(self, key: int, now: int) -> int:
        """The first step after ``now`` that uses ``key``, or NEVER."""
        lst = self._uses.get(key)
        if lst is None:
            return NEVER
        i = self._pos[key]
        n = len(lst)
        while i < n and lst[i] <= now:
            i += 1
        self._pos[key] = i
        return lst[i] if i < n else NEVER


@register
class Belady(EvictionPolicy):
    name = "belady"
    kernel = "belady"  # sim/kernels/belady.py
    description = "offline optimum (Belady's MIN): evict the key used farthest in the future; replays only"
    needs_future = True

    def __init__(self, capacity: int, **params: object) -> None:
        super().__init__(capacity)
        self._future: Future | None = None
        self._entry: dict[int, tuple[int, int]] = {}  # resident key -> its live (-next use, key)
        self._heap: list[tuple[int, int]] = []          # min-heap of items; stale ones skipped

    def bind_future(self, future: object) -> None:
        if not hasattr(future, "next_use"):
            raise TypeError("belady needs a Future (an object with next_use(key, now))")
        self._future = future

    def _touch(self, key: int, now: int) -> None:
        if self._future is None:
            raise ValueError("policy 'belady' is an offline oracle: bind the future first "
                             "(it runs only in replays of a known trace: expertcache sim / bench)")
        item = (-self._future.next_use(key, now), key)
        self._entry[key] = item
        heapq.heappush(self._heap, item)

    on_insert = _touch
    on_access = _touch

    def on_remove(self, key: int) -> None:
        del self._entry[key]

    def victim(self, protected) -> int | None:
        return lowest_live(self._heap, self._entry, protected)
