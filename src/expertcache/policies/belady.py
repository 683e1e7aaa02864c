"""Belady's MIN: evict the key whose next use is farthest in the future.

The offline optimum under forced admission (every miss is cached). It needs
the whole future, so it works only in replays of a known trace; a table that
uses it without ``bind_future`` refuses to step. The logic is compiled:
``policies/kernels/belady.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .base import EvictionPolicy
from .registry import register

NEVER = 1 << 62  # "not used again": later than any step


class Future:
    """The steps that use each key, over a known sequence of steps.

    ``steps[s]`` lists the keys step ``s`` uses; the table's clock ``now`` is the
    step index. Held as ``arrays``: every key's use steps in order (``uses``, from
    ``starts[key]`` to ``starts[key + 1]``), the layout the compiled policy reads.
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
        nkeys = max(uses, default=-1) + 1
        starts = np.zeros(nkeys + 1, np.int64)
        for key, lst in uses.items():
            starts[key + 1] = len(lst)
        np.cumsum(starts, out=starts)
        flat = np.empty(int(starts[-1]), np.int64)
        for key, lst in uses.items():
            flat[starts[key]:starts[key + 1]] = lst
        self._starts, self._uses = starts, flat

    @classmethod
    def from_arrays(cls, starts: np.ndarray, uses: np.ndarray, rows: np.ndarray | None = None,
                    nexts: np.ndarray | None = None) -> Future:
        """A future already in ``arrays`` form (the simulator builds it compiled). With
        ``rows`` (int32 [S, W], the steps' keys, -1 none) and ``nexts`` (int32 [S, W], the
        next step using each, or int32's maximum for never), a step whose keys sit in the same columns reads
        its next uses in order instead of searching each key's list."""
        self = cls.__new__(cls)
        self._starts, self._uses = starts, uses
        self._rows, self._nexts = rows, nexts
        return self

    _rows = _nexts = None

    def arrays(self, nkeys: int) -> tuple[np.ndarray, ...]:
        """``(starts int64 [nkeys + 1], uses int64, rows, nexts)``, padded to ``nkeys``
        keys; ``rows`` and ``nexts`` are empty ``[0, 1]`` when not given."""
        starts = self._starts
        if len(starts) < nkeys + 1:  # keys never used
            starts = np.concatenate([starts, np.full(nkeys + 1 - len(starts), starts[-1])])
        rows, nexts = self._rows, self._nexts
        if rows is None or nexts is None:
            rows, nexts = np.full((0, 1), -1, np.int32), np.zeros((0, 1), np.int32)
        return starts[:nkeys + 1], self._uses, rows, nexts

    def next_use(self, key: int, now: int) -> int:
        """The first step after ``now`` that uses ``key``, or NEVER."""
        if not 0 <= key < len(self._starts) - 1:
            return NEVER
        lo, hi = int(self._starts[key]), int(self._starts[key + 1])
        i = lo + int(np.searchsorted(self._uses[lo:hi], now, side="right"))
        return int(self._uses[i]) if i < hi else NEVER


@register
class Belady(EvictionPolicy):
    name = "belady"
    kernel = "belady"  # policies/kernels/belady.py
    description = "offline optimum (Belady's MIN): evict the key used farthest in the future; replays only"
    needs_future = True

    def __init__(self, capacity: int, **params: object) -> None:
        super().__init__(capacity)
        self._future: Future | None = None

    def bind_future(self, future: object) -> None:
        if not isinstance(future, Future):
            raise TypeError("belady needs a Future (expertcache.policies.belady.Future)")
        self._future = future

    def future_arrays(self, nkeys: int) -> tuple[np.ndarray, ...]:
        """The bound future as the compiled policy reads it (``Future.arrays``)."""
        if self._future is None:
            raise ValueError("policy 'belady' is an offline oracle: bind the future first "
                             "(it runs only in replays of a known trace: expertcache sim / bench)")
        return self._future.arrays(nkeys)
