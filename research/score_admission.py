"""next-use with score-based admission (bypass a fresh key scoring below the victim); needs proto.RTable.

Run from the repository root: .venv/bin/python research/score_admission.py [args]."""
import sys, math
sys.path.insert(0, "research")
from bisect import bisect_right
from proto import RTable
from replay import steps_of, replay
from expertcache.policies.next_use import NextUse, _EDGES, _GAPS
class A(NextUse):
    BIAS = 0.0
    def admit(self, cand, victim, now):
        # candidate's class after this use, age 0; victim's current score
        when = self._when.get(cand)
        if when is None:
            c = 1.0
        else:
            passes = (now - when) / (self._period or 1)
            c = 1.0 + self._count[cand] * math.exp(-passes / self.window)
        sc = self._score[bisect_right(_EDGES, c)][0]
        vw = self._when[victim]
        sv = self._score[self._class[victim]][min((self._now - vw) // (self._period or 1), _GAPS)]
        ok = sc + self.BIAS >= sv
        if not ok:
            self._use(cand, now)   # learn from the bypassed access too
        return ok
name = sys.argv[1]
steps, L, E, k = steps_of(name, 1000)
configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
for bias in (0.0, 0.05, -0.05):
    A.BIAS = bias
    r = []
    for part, slots in configs:
        t = RTable(L, E, slots, eviction="next-use", partition=part, top_k=k)
        for p in t._parts: p.policy = A(p.capacity)
        for l, ex in steps: t.step(l, ex)
        r.append(t.stats().total().misses / base[(part, slots)])
    print(bias, " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/4:.3f}", flush=True)
