"""How fast should the gap histogram forget? Full-trace replays at one config with
halve_every / rebuild_every set per run (reuses)."""
import sys
sys.path.insert(0, "research")
from replay import steps_of, replay
from expertcache import SlotTable
from expertcache.policies.next_use import NextUse

name, tokens, part, slots = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
steps, L, E, k = steps_of(name, tokens)
b = replay(steps, L, E, k, slots, part, "belady")[0]
print("lru", round(replay(steps, L, E, k, slots, part, "lru")[0] / b, 3), flush=True)
for spec in sys.argv[5:]:
    halve, rebuild = map(int, spec.split(","))
    cls = type("V", (NextUse,), {"halve_every": halve, "rebuild_every": rebuild})
    t = SlotTable(L, E, slots, eviction="next-use", partition=part, top_k=k)
    for p in t._parts:
        p.policy = cls(p.capacity)
    for l, ex in steps: t.step(l, ex)
    print(spec, round(t.stats().total().misses / b, 3), flush=True)
