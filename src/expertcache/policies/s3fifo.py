"""S3-FIFO (Yang et al., SOSP 2023): a small probation FIFO, a main FIFO, a ghost FIFO.

New keys enter the small queue S (target ``small`` x capacity, default 10%);
keys that come back after leaving S (still in the ghost queue G, which keeps
the last ``capacity`` keys evicted from S) go straight to the main queue M.
Each resident key counts its hits, capped at 3. When S is at or over its
target (or M is empty) the eviction works on S: its oldest keys that were hit
move to M (count 0), the first unhit one is the victim (and enters G); if
every key of S was hit, all of S moves to M and M's eviction runs. Otherwise
M acts as a CLOCK: hit keys get a second chance (count - 1, moved to the back)
and the first key with count 0 is the victim (it does not enter G).

On one key per step this is exactly libCacheSim's original S3-FIFO
(``S3FIFOv0`` with move-to-main-threshold 1 and ghost-size-ratio 1.0, where
its small size ``capacity x small`` is a whole number of at least 2;
tests/test_libcachesim.py). libCacheSim's newer ``S3FIFO`` also sends new keys
to M while S is full and nothing was evicted yet.

``victim`` must be a pure query, so it computes where that sweep would stop
without doing it; ``on_remove`` then performs the sweep up to the victim. In
M the sweep's result is exact: the victim is the first key with the lowest
count (a key with count f survives f passes), keys before it lose f + 1, keys
after it lose f, and the keys before it rotate to the back. Keys of the
current step (protected) are skipped, never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy
from .registry import register

MAX_FREQ = 3


@register
class S3FIFO(EvictionPolicy):
    name = "s3fifo"
    kernel = "s3fifo"  # sim/kernels/s3fifo.py
    description = "S3-FIFO: small probation FIFO (`small` share, default 0.1), main CLOCK FIFO, ghost FIFO"
    params = {"small": 0.1}

    def __init__(self, capacity: int, small: float = 0.1, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(small, bool) or not isinstance(small, (int, float)) or not 0 < small < 1:
            raise ValueError(f"parameter 'small' of policy 's3fifo' is the small queue's share of "
                             f"the capacity: a number in (0, 1), got {small!r}")
        self.small_target = max(1, round(small * capacity))
        self._small: OrderedDict[int, int] = OrderedDict()  # key -> hit count, oldest first
        self._main: OrderedDict[int, int] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()  # keys evicted from S, bounded by capacity

    def queues(self) -> dict[str, dict[int, int] | list[int]]:
        """Queue contents, oldest first (for tests and reports)."""
        return {"small": dict(self._small), "main": dict(self._main), "ghost": list(self._ghost)}

    def on_insert(self, key: int, now: int) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0
        # Trim only now: the key looks in G before the eviction that made room for it
        # added its victim (as S3-FIFO checks G on the miss, before evicting).
        while len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)

    def on_access(self, key: int, now: int) -> None:
        queue = self._small if key in self._small else self._main
        if queue[key] < MAX_FREQ:
            queue[key] += 1

    def on_remove(self, key: int) -> None:
        if self._promotion_due():
            # S's eviction found no unhit key: all of S moved to M first (victim() chose in
            # the M that results), then M's CLOCK ran.
            for older in self._small:
                self._main[older] = 0
            self._small.clear()
            self._sweep_main(key)
        elif key in self._small:
            self._sweep_small(key)
            self._ghost[key] = None  # G may hold capacity + 1 until the next insert trims it
        else:
            self._sweep_main(key)

    def _sweep_small(self, key: int) -> None:
        """Promote the hit keys in front of ``key`` to M, keep unhit ones in front, drop ``key``."""
        small, kept = self._small, []
        while True:
            older, count = small.popitem(last=False)
            if older == key:
                break
            if count > 0:
                self._main[older] = 0
            else:
                kept.append(older)  # skipped because the step needed it
        for older in reversed(kept):
            small[older] = 0
            small.move_to_end(older, last=False)

    def _sweep_main(self, key: int) -> None:
        """The CLOCK sweep that stops at ``key``: keys passed lose f + 1 and go to the back."""
        main = self._main
        f = main[key]
        passed = []  # keys in front of the victim: examined f + 1 times
        while True:
            other, count = main.popitem(last=False)
            if other == key:
                break
            passed.append((other, count))
        if f:  # keys behind the victim were examined f times (the hand went round f times)
            for other in main:
                main[other] = max(0, main[other] - f)
        # Only now append the passed keys, so they lose f + 1 once, not f more on top.
        for other, count in passed:
            main[other] = max(0, count - f - 1)

    def victim(self, protected) -> int | None:
        if self._small_due():
            unhit = False
            for key, count in self._small.items():
                if count == 0:
                    if key not in protected:
                        return key
                    unhit = True
            if self._small and not unhit:  # every key of S was hit: S moves to M (count 0)
                found = self._main_victim(protected)
                if found is not None and self._main[found] == 0:
                    return found  # a count-0 key of M comes before the promoted ones
                promoted = next((k for k in self._small if k not in protected), None)
                return found if promoted is None else promoted
        found = self._main_victim(protected)
        if found is None:  # nothing evictable in M: take S's oldest unprotected key
            found = next((k for k in self._small if k not in protected), None)
        return found

    def _small_due(self) -> bool:
        """The eviction works on S: S at or over its target, or M empty."""
        return len(self._small) >= self.small_target or not self._main

    def _promotion_due(self) -> bool:
        """S is due but none of its keys is unhit: all of it moves to M before the sweep."""
        return bool(self._small) and self._small_due() and all(self._small.values())

    def _main_victim(self, protected) -> int | None:
        """First key with the lowest count; stops early at the first count 0."""
        best, best_count = None, MAX_FREQ + 1
        for key, count in self._main.items():
            if count < best_count and key not in protected:
                best, best_count = key, count
                if count == 0:
                    break
        return best
