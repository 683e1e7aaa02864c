"""next-use with other scores: hit density E[1/(g-a)] and exponential discounts.

Run from the repository root: .venv/bin/python research/score_functions.py [args]."""
import sys, math
sys.path.insert(0, "research")
from replay import steps_of, replay
from expertcache import SlotTable
from expertcache.policies.next_use import NextUse, _GAPS
class V(NextUse):
    MODE = ("density", 0)
    def _rebuild(self):
        mode, tau = self.MODE
        top = _GAPS + 1
        for row, score in zip(self._hist, self._score):
            later = [0.0] * (top + 1)
            for g in range(top, 0, -1):
                later[g - 1] = later[g] + row[g]
            for a in range(top):
                if not later[a]:
                    score[a] = 0.0; continue
                if mode == "density":
                    s = sum(row[g] / (g - a) for g in range(a + 1, top))
                else:
                    s = sum(row[g] * math.exp(-(g - a) / tau) for g in range(a + 1, top))
                score[a] = s / later[a]
name = sys.argv[1]
steps, L, E, k = steps_of(name, 1000)
configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
for mode in [("density", 0), ("exp", 1.0), ("exp", 3.0), ("exp", 8.0)]:
    V.MODE = mode
    r = []
    for part, slots in configs:
        t = SlotTable(L, E, slots, eviction="next-use", partition=part, top_k=k)
        for p in t._parts: p.policy = V(p.capacity)
        for l, ex in steps: t.step(l, ex)
        r.append(t.stats().total().misses / base[(part, slots)])
    print(mode, " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/4:.3f}", flush=True)
