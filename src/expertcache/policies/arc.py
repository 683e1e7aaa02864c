"""ARC (Megiddo & Modha 2003): recency and frequency lists with self-tuning sizes.

T1 holds keys used once since they were loaded, T2 keys used again; ghost
lists B1 and B2 remember keys recently evicted from each. A miss on a key in
B1 says T1 was too small, so the target size ``p`` of T1 grows; a miss in B2
shrinks it. The victim is T1's least recent key while T1 exceeds ``p``, else
T2's. Ghosts are trimmed so that |T1| + |B1| <= c and the four lists <= 2c.

One adaptation to the slot table's order of calls: ``victim`` is asked before
the missed key is inserted and does not know that key, so ``p`` adapts on the
insert (after the eviction), and the "key in B2 and |T1| == p" tie of the
paper evicts from T2. The logic is compiled: ``policies/kernels/arc.py``.
"""

from __future__ import annotations

from .base import EvictionPolicy
from .registry import register


@register
class ARC(EvictionPolicy):
    name = "arc"
    kernel = "arc"  # policies/kernels/arc.py
    description = "adaptive replacement cache: recency and frequency lists with ghost-tuned sizes"
