"""First in, first out: evict the key resident longest; hits change nothing."""

from __future__ import annotations

from .base import NOTHING
from .lru import LRU
from .registry import register


@register
class FIFO(LRU):
    name = "fifo"
    kernel = "lru"  # sim/kernels/lru.py (hits do not reorder)
    description = "first in, first out: evict the key that was loaded longest ago; hits do not reorder"

    def on_access(self, key: int, now: int) -> None:
        pass

    def key_only_hooks(self):
        cls = type(self)
        if cls.on_access is FIFO.on_access and cls.on_insert is LRU.on_insert:
            return NOTHING, self._order.setdefault
        return None
