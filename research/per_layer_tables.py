"""Ceiling check: next-use with one score table per layer in a global pool (layer = key // E,
known here; a shipped version would infer it from the step clock). Brute-force victim scan."""
import sys, math
sys.path.insert(0, "research")
from bisect import bisect_right
from collections import OrderedDict
from replay import steps_of, replay
from expertcache import SlotTable
from expertcache.policies.next_use import NextUse, _EDGES, _GAPS, _NCLASS, _MIN_OBS

E = 128
class PerLayer(NextUse):
    def __init__(self, cap, layers=48, **kw):
        super().__init__(cap, **kw)
        n = layers * _NCLASS
        self._classes = [OrderedDict() for _ in range(n)]
        self._hist = [[0.0] * (_GAPS + 2) for _ in range(n)]
        self._score = [[0.0] * (_GAPS + 1) for _ in range(n)]
        self._cur = None
    def _use(self, key, now):
        self._cur = key // E
        return (key // E) * _NCLASS + NextUse._use(self, key, now)
    def _rebuild(self):
        for lay in range(len(self._hist) // _NCLASS):
            rows = self._hist[lay * _NCLASS:(lay + 1) * _NCLASS]
            pooled = self._scores([sum(col) for col in zip(*rows)])
            for c, row in enumerate(rows):
                self._score[lay * _NCLASS + c] = self._scores(row) if sum(row) >= _MIN_OBS else pooled
# histogram update in NextUse._use indexes by count class only: patch to layer-specific
def _use_hist(self, key, now):
    self._now = now
    when = self._when.get(key)
    lay = key // E
    if when is None:
        count = 1.0
    elif now > when:
        steps = now - when
        if self._period == 0 or steps < self._period:
            self._period = steps
        passes = steps / self._period
        old = self._count[key]
        self._hist[lay * _NCLASS + bisect_right(_EDGES, old)][min(round(passes), _GAPS + 1)] += 1.0
        count = 1.0 + old * math.exp(-passes / self.window)
        self._seen += 1
        if self._seen % self.rebuild_every == 0:
            self._rebuild()
    else:
        count = self._count[key]
    self._when[key] = now
    self._count[key] = count
    return lay * _NCLASS + bisect_right(_EDGES, count)
PerLayer._use = _use_hist

name = sys.argv[1] if len(sys.argv) > 1 else "code"
steps, L, E_, k = steps_of(name, 1000)
for slots in (768, 1536):
    b = replay(steps, L, E, k, slots, "global", "belady")[0]
    t = SlotTable(L, E, slots, eviction="next-use", partition="global", top_k=k)
    t._parts[0].policy = PerLayer(slots)
    for l, ex in steps: t.step(l, ex)
    print(slots, round(t.stats().total().misses / b, 3), flush=True)
