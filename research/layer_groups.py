"""Round two: misses by layer group, Belady vs default vs LRU, global pool, full code trace.
Is the global pool badly shared between layers? (No: default is 1.58-1.71x Belady in every
group at 768 slots, 1.82-2.02x at 1536; layers 0-7 and 40-47 a little worse.)

    .venv/bin/python research/layer_groups.py
"""
import numpy as np
from expertcache.sim.replay import Prepared, replay
from expertcache.trace import load_trace
prep = Prepared(load_trace("../shared/traces/qwen3-30b-a3b-code.npz"))
for slots in (768, 1536):
    ep = {"window": 64.0, "horizon": 4}  # round one's setting, as in the doc
    res = {p: replay(prep, p, slots, "global", eviction_params=ep if p == "next-use" else None).stats
           for p in ("belady", "next-use", "lru")}
    m = {p: np.array([res[p].layer(l).misses for l in range(48)]) for p in res}
    print(slots, "misses by layer group (8 layers each): belady / next-use (round one) / lru")
    for g in range(6):
        sl = slice(8*g, 8*g+8)
        print(f"  layers {8*g:2d}-{8*g+7:2d}", m["belady"][sl].sum(), m["next-use"][sl].sum(), m["lru"][sl].sum(), f"{m['next-use'][sl].sum()/m['belady'][sl].sum():.2f}")
