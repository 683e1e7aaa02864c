"""How many slots per layer Belady / next-use / LRU hold in a global pool, and hit rate per layer.

Run from the repository root: .venv/bin/python research/per_layer_residency.py [args]."""
import sys, collections
sys.path.insert(0, "research")
from replay import steps_of
from expertcache import SlotTable
from expertcache.policies.belady import Future
steps, L, E, k = steps_of("code", 1000)
for pol in ("belady", "next-use", "lru"):
  for slots in (768, 1536):
    t = SlotTable(L, E, slots, eviction=pol, partition="global", top_k=k)
    if pol == "belady": t.bind_future(Future([[l * E + e for e in ex] for l, ex in steps]))
    for s, (l, ex) in enumerate(steps):
        t.step(l, ex)
        if s == 500*L:
            res = collections.Counter(key // E for key in t.resident())
    st = t.stats()
    print(pol, slots, "resident/layer @500", [res[l] for l in range(L)])
    print("   hit/layer", [round(st.layer(l).hit_rate*100) for l in range(L)])
