"""Global pool: among keys with equal score, evict the one whose next opportunity (its layer's
next step) is farthest, instead of the least recently used. Brute-force victim scan."""
import sys
sys.path.insert(0, "research")
from replay import steps_of, replay
from expertcache import SlotTable
from expertcache.policies.next_use import NextUse, _GAPS

class Opp(NextUse):
    def victim(self, protected):
        when, P, now = self._when, self._period or 1, self._now
        best, best_rank = None, None
        for keys, score in zip(self._classes, self._score):
            for key in keys:
                if key in protected:
                    continue
                last = when[key]
                age = (now - last) // P
                rank = (score[min(age, _GAPS)], -(last + P * (age + 1)))
                if best_rank is None or rank < best_rank:
                    best, best_rank = key, rank
        return best

name = sys.argv[1] if len(sys.argv) > 1 else "code"
steps, L, E, k = steps_of(name, 1000)
for slots in (768, 1536):
    b = replay(steps, L, E, k, slots, "global", "belady")[0]
    t = SlotTable(L, E, slots, eviction="next-use", partition="global", top_k=k)
    t._parts[0].policy = Opp(slots)
    for l, ex in steps: t.step(l, ex)
    print(slots, round(t.stats().total().misses / b, 3), flush=True)
