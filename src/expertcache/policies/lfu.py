"""Least frequently used, with aging so that old popularity fades.

Counts are kept for resident keys only (a new key starts at 1). Every
``decay`` touches (inserts plus hits) all counts are halved (rounded down), so a
key that was hot long ago cannot squat a slot forever: the "all-time LFU lost
16% to LRU" failure in the field notes. ``decay=0`` picks 8 x capacity.
Ties go to the key touched least recently. The logic is compiled
(``policies/kernels/lfu.py``: an indexed min-heap per partition).
"""

from __future__ import annotations

from .base import EvictionPolicy
from .registry import register


@register
class LFU(EvictionPolicy):
    name = "lfu"
    kernel = "lfu"  # policies/kernels/lfu.py
    description = "least frequently used; all counts halve every `decay` touches (0 = 8 x capacity)"
    params = {"decay": 0}

    def __init__(self, capacity: int, decay: int = 0, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(decay, bool) or not isinstance(decay, int) or decay < 0:
            raise ValueError(f"parameter 'decay' of policy 'lfu' must be a whole number >= 0, got {decay!r}")
        self.decay = decay or 8 * capacity
