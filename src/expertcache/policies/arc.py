"""ARC (Megiddo & Modha 2003): recency and frequency lists with self-tuning sizes.

T1 holds keys used once since they were loaded, T2 keys used again; ghost
lists B1 and B2 remember keys recently evicted from each. A miss on a key in
B1 says T1 was too small, so the target size ``p`` of T1 grows; a miss in B2
shrinks it. The victim is T1's least recent key while T1 exceeds ``p``, else
T2's. Ghosts are trimmed so that |T1| + |B1| <= c and the four lists <= 2c.

One adaptation to the slot table's order of calls: ``victim`` is asked before
the missed key is inserted and does not know that key, so ``p`` adapts on the
insert (after the eviction), and the "key in B2 and |T1| == p" tie of the
paper evicts from T2.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy
from .registry import register


@register
class ARC(EvictionPolicy):
    name = "arc"
    kernel = "arc"  # sim/kernels/arc.py
    description = "adaptive replacement cache: recency and frequency lists with ghost-tuned sizes"

    def __init__(self, capacity: int, **params: object) -> None:
        super().__init__(capacity)
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[int, None] = OrderedDict()  # each list oldest first
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()

    def lists(self) -> dict[str, list[int]]:
        """The four lists, oldest first (for tests and reports)."""
        return {"t1": list(self._t1), "t2": list(self._t2), "b1": list(self._b1), "b2": list(self._b2)}

    def on_insert(self, key: int, now: int) -> None:
        c = self.capacity
        if key in self._b1:  # T1 was too small
            self.p = min(float(c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:  # T2 was too small
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim()

    def on_access(self, key: int, now: int) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def on_remove(self, key: int) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        self._trim()

    def _trim(self) -> None:
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def victim(self, protected) -> int | None:
        first, second = (self._t1, self._t2) if len(self._t1) > self.p else (self._t2, self._t1)
        for segment in (first, second):
            for key in segment:
                if key not in protected:
                    return key
        return None
