"""Round two: microseconds per next-use victim() call, timed directly (timeit) on a learned state.

The replay-based figure (decision_cost.py: twice-minus-once over a whole replay) swings by
+-0.3 us on the shared 2-core machine; this one times victim() alone, best of 5 x 200000
calls, on the state after N tokens, protected = the last step's keys. It also times the
first round's victim() (kept here as `first_round`) on the same state, and checks both agree.

    .venv/bin/python research/victim_micro.py code 600
"""
import sys
import timeit
sys.path.insert(0, "research")
from replay import steps_of
from expertcache import SlotTable
from expertcache.policies.next_use import _GAPS


def first_round(self, protected):
    period, now = self._period or 1, self._now
    best, best_score, best_last = None, 2.0, 0
    for members, score in zip(self._classes, self._score):
        for key, last in members.items():
            if key in protected:
                continue
            age = (now - last) // period
            odds = score[age] if age < _GAPS else score[_GAPS]
            if odds < best_score or (odds == best_score and last < best_last):
                best, best_score, best_last = key, odds, last
            break
    return best


name, tokens = sys.argv[1], int(sys.argv[2])
steps, L, E, k = steps_of(name, tokens)
for part in ("global", "per-layer"):
    table = SlotTable(L, E, 768, eviction="next-use", partition=part, top_k=k)
    for layer, ex in steps:
        table.step(layer, ex)
    layer, ex = steps[-1]
    protected = {layer * E + e for e in ex}
    policy = table._part_of_layer[layer].policy
    assert first_round(policy, protected) == policy.victim(protected)
    for label, f in (("now", type(policy).victim), ("first round", first_round)):
        n = 200000
        dt = min(timeit.repeat(lambda: f(policy, protected), number=n, repeat=5)) / n
        print(f"{part:9s} {label:11s} {dt * 1e6:.2f} us per victim()", flush=True)
