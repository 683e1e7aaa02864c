"""Least recently used: evict the key whose last use is oldest."""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy
from .registry import register


@register
class LRU(EvictionPolicy):
    name = "lru"
    kernel = "lru"  # sim/kernels/lru.py
    description = "least recently used: evict the key whose last use is oldest"

    def __init__(self, capacity: int, **params: object) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def on_insert(self, key: int, now: int) -> None:
        self._order[key] = None

    def on_access(self, key: int, now: int) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: int) -> None:
        del self._order[key]

    def victim(self, protected) -> int | None:
        for key in self._order:
            if key not in protected:
                return key
        return None

    def key_only_hooks(self):
        # OrderedDict's own methods do what on_access / on_insert do, minus a Python
        # call per access (the table's hot path). Subclasses that override a hook opt out.
        cls = type(self)
        if cls.on_access is LRU.on_access and cls.on_insert is LRU.on_insert:
            return self._order.move_to_end, self._order.setdefault
        return None
