"""CPU microseconds per eviction decision and per access for a policy, first N tokens of a trace.

victim() is a pure query, so calling it twice per decision instead of once (both through the
same wrapper) adds exactly one decision's cost: (T_twice - T_once) / decisions. Per access:
the whole replay's process time / accesses (SlotTable included). process_time, not wall time,
so other load on the machine inflates the figures less.
"""
import sys
import time
sys.path.insert(0, "research")
from replay import steps_of
from expertcache import SlotTable


def run(steps, L, E, k, policy, part, calls):
    table = SlotTable(L, E, 768, eviction=policy, partition=part, top_k=k)
    n = [0]
    for p in table._parts:
        f = p.policy.victim
        def victim(protected, _f=f):
            n[0] += 1
            for _ in range(calls - 1):
                _f(protected)
            return _f(protected)
        p.policy.victim = victim
    t0 = time.process_time()
    for layer, ex in steps:
        table.step(layer, ex)
    return time.process_time() - t0, n[0], table.stats().total().accesses


name, tokens = sys.argv[1], int(sys.argv[2])
steps, L, E, k = steps_of(name, tokens)
for policy in sys.argv[3:]:
    for part in ("global", "per-layer"):
        once = min(run(steps, L, E, k, policy, part, 1) for _ in range(2))
        twice = min(run(steps, L, E, k, policy, part, 2) for _ in range(2))
        print(f"{policy:9s} {part:9s} decision {(twice[0] - once[0]) / once[1] * 1e6:.2f} us, "
              f"access {once[0] / once[2] * 1e6:.2f} us (SlotTable included)", flush=True)
