"""First in, first out: evict the key resident longest; hits change nothing.

The logic is compiled: ``policies/kernels/lru.py`` with ``reorders`` off.
"""

from __future__ import annotations

from .lru import LRU
from .registry import register


@register
class FIFO(LRU):
    name = "fifo"
    description = "first in, first out: evict the key that was loaded longest ago; hits do not reorder"
    reorders = False
