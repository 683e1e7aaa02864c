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

The logic is compiled (``policies/kernels/s3fifo.py``). The victim search is a pure
query: it computes where that sweep would stop without doing it; the eviction then
performs the sweep up to the victim. In M the sweep's result is exact: the victim is the first key with the lowest
count (a key with count f survives f passes), keys before it lose f + 1, keys
after it lose f, and the keys before it rotate to the back. Keys of the
current step (protected) are skipped, never evicted.
"""

from __future__ import annotations

from .base import EvictionPolicy
from .registry import register

MAX_FREQ = 3


@register
class S3FIFO(EvictionPolicy):
    name = "s3fifo"
    kernel = "s3fifo"  # policies/kernels/s3fifo.py
    description = "S3-FIFO: small probation FIFO (`small` share, default 0.1), main CLOCK FIFO, ghost FIFO"
    params = {"small": 0.1}

    def __init__(self, capacity: int, small: float = 0.1, **params: object) -> None:
        super().__init__(capacity)
        if isinstance(small, bool) or not isinstance(small, (int, float)) or not 0 < small < 1:
            raise ValueError(f"parameter 'small' of policy 's3fifo' is the small queue's share of "
                             f"the capacity: a number in (0, 1), got {small!r}")
        self.small = small
        self.small_target = max(1, round(small * capacity))
