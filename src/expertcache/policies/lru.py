"""Least recently used: evict the key whose last use is oldest.

The logic is compiled: ``policies/kernels/lru.py`` (shared with ``fifo``).
"""

from __future__ import annotations

from .base import EvictionPolicy
from .registry import register


@register
class LRU(EvictionPolicy):
    name = "lru"
    kernel = "lru"  # policies/kernels/lru.py
    description = "least recently used: evict the key whose last use is oldest"
    reorders = True  # a hit moves the key to the recent end (FIFO: it does not)
