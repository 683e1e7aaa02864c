"""Ceiling of next-token knowledge: next-use plus an oracle that protects keys used within D steps (global pool).

Run from the repository root: .venv/bin/python research/lookahead_oracle.py [args]."""
import sys
sys.path.insert(0, "research")
from replay import steps_of, replay
from expertcache import SlotTable
from expertcache.policies.belady import Future
from expertcache.policies.next_use import NextUse
steps, L, E, k = steps_of("code", 1000)
class Look(NextUse):
    D = 48
    def bind_future(self, f): self.f = f
    def victim(self, protected):
        now = self._now
        f = self.f
        class P:
            def __contains__(s, key): return key in protected or f.next_use(key, now) <= now + Look.D
        v = super().victim(P())
        return v if v is not None else super().victim(protected)
for D in (0, 24, 48, 96):
    Look.D = D
    for slots in (768, 1536):
        b = replay(steps, L, E, k, slots, "global", "belady")[0]
        t = SlotTable(L, E, slots, eviction="next-use", partition="global", top_k=k)
        t._parts[0].policy = Look(slots)
        t._parts[0].policy.bind_future(Future([[l * E + e for e in ex] for l, ex in steps]))
        for l, ex in steps: t.step(l, ex)
        print(D, slots, round(t.stats().total().misses / b, 3))
