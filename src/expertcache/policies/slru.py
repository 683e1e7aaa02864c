"""Segmented LRU: a probation segment for new keys, a protected one for reused keys.

A key enters probation; a hit there promotes it to the protected segment, whose
size is capped at ``protected`` x capacity (default 80%); the overflow (its
least recently used key) drops back to probation's most recent end. Victims
come from probation first, so one-off experts of a prefill burst cannot flush
the experts that decode keeps reusing. The logic is compiled: ``policies/kernels/slru.py``.
"""

from __future__ import annotations

from .base import EvictionPolicy
from .registry import register


@register
class SLRU(EvictionPolicy):
    name = "slru"
    kernel = "slru"  # policies/kernels/slru.py
    description = "segmented LRU: probation then protected segment (`protected` share, default 0.8)"
    params = {"protected": 0.8}

    def __init__(self, capacity: int, protected: float = 0.8, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(protected, bool) or not isinstance(protected, (int, float)) or not 0 <= protected < 1:
            raise ValueError(f"parameter 'protected' of policy 'slru' is the protected segment's share "
                             f"of the capacity: a number in [0, 1), got {protected!r}")
        self.protected = protected
        self.protected_cap = int(protected * capacity)
