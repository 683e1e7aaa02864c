"""Segmented LRU: a probation segment for new keys, a protected one for reused keys.

A key enters probation; a hit there promotes it to the protected segment, whose
size is capped at ``protected`` x capacity (default 80%); the overflow (its
least recently used key) drops back to probation's most recent end. Victims
come from probation first, so one-off experts of a prefill burst cannot flush
the experts that decode keeps reusing.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy
from .registry import register


@register
class SLRU(EvictionPolicy):
    name = "slru"
    kernel = "slru"  # sim/kernels/slru.py
    description = "segmented LRU: probation then protected segment (`protected` share, default 0.8)"
    params = {"protected": 0.8}

    def __init__(self, capacity: int, protected: float = 0.8, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(protected, bool) or not isinstance(protected, (int, float)) or not 0 <= protected < 1:
            raise ValueError(f"parameter 'protected' of policy 'slru' is the protected segment's share "
                             f"of the capacity: a number in [0, 1), got {protected!r}")
        self.protected_cap = int(protected * capacity)
        self._probation: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[int, None] = OrderedDict()  # oldest first

    def segment(self, key: int) -> str | None:
        """'probation', 'protected' or None (not resident); for tests and reports."""
        if key in self._probation:
            return "probation"
        return "protected" if key in self._protected else None

    def on_insert(self, key: int, now: int) -> None:
        self._probation[key] = None

    def on_access(self, key: int, now: int) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        del self._probation[key]
        self._protected[key] = None
        if len(self._protected) > self.protected_cap:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def on_remove(self, key: int) -> None:
        if key in self._probation:
            del self._probation[key]
        else:
            del self._protected[key]

    def victim(self, protected) -> int | None:
        for segment in (self._probation, self._protected):
            for key in segment:
                if key not in protected:
                    return key
        return None
