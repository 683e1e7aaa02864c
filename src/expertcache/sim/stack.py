"""LRU at every size from one pass of stack distances (plain LRU, admission always).

Under step protection the victim is always the least recent key *outside* the step, and
every key of a step ends at the recent end in rank order. By induction a full cache then
holds exactly the ``C`` most recently used keys (recency = position in the flattened
access sequence), so a key is a hit iff fewer than ``C`` distinct keys were used between
its last use and the *start* of its step. The pass measures that distance for every
access (Fenwick tree over positions, queries before the step's updates), and a histogram
answers every capacity at once. Tested equal to the lru kernel (tests/test_sim_fast.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..policies.kernels.skeleton import ACC, EVICT, HIT, LOAD, MISS
