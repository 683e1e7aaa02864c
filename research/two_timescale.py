"""next-use with a second, short-window count in the class (2-D classes).

Run from the repository root: .venv/bin/python research/two_timescale.py [args]."""
import sys, math
sys.path.insert(0, "research")
from collections import OrderedDict
from replay import steps_of, replay
from expertcache import SlotTable
from bisect import bisect_right
from expertcache.policies.next_use import NextUse, _EDGES, _GAPS
SE = (1.5, 2.2, 3.0)
class Two(NextUse):
    SHORT = 4.0
    def __init__(self, cap, **kw):
        super().__init__(cap, **kw)
        n = (len(_EDGES) + 1) * (len(SE) + 1)
        self._classes = [OrderedDict() for _ in range(n)]
        self._hist = [[0.0] * (_GAPS + 2) for _ in range(n)]
        self._score = [[0.0] * (_GAPS + 1) for _ in range(n)]
    def _cls(self, c, s):
        j = 0
        while j < len(SE) and s >= SE[j]: j += 1
        return bisect_right(_EDGES, c) * (len(SE) + 1) + j
    def _use(self, key, now):
        self._now = now
        prev = self._last.get(key)
        count, sc = 1.0, 1.0
        if prev is not None and now > prev[0]:
            steps = now - prev[0]
            if self._period == 0 or steps < self._period: self._period = steps
            passes = steps / self._period
            self._hist[self._cls(prev[1], prev[2])][min(round(passes), _GAPS + 1)] += 1.0
            count += prev[1] * math.exp(-passes / self.window)
            sc += prev[2] * math.exp(-passes / self.SHORT)
            self._seen += 1
            if self._seen % self.rebuild_every == 0: self._rebuild()
        elif prev is not None:
            count, sc = prev[1], prev[2]
        self._last[key] = (now, count, sc)
        return self._cls(count, sc)
steps, L, E, k = steps_of("code", 1000)
configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
for short in (2.0, 4.0):
    Two.SHORT = short
    r = []
    for part, slots in configs:
        t = SlotTable(L, E, slots, eviction="next-use", partition=part, top_k=k)
        for p in t._parts: p.policy = Two(p.capacity, horizon=2, window=64)
        for l, ex in steps: t.step(l, ex)
        r.append(t.stats().total().misses / base[(part, slots)])
    print(short, " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/4:.3f}", flush=True)
