"""Research prototypes: a table whose eviction policy may also veto admission
(policy.admit(candidate, victim)), and candidate policies (not registered)."""

from __future__ import annotations

import heapq
import math
import sys

from expertcache.cache import Plan, SlotTable
from expertcache.policies.base import EvictionPolicy
from expertcache.policies.belady import Future

from replay import steps_of


class RTable(SlotTable):
    def _step(self, layer, experts, phase):
        part = self._part_of_layer[layer]
        policy = part.policy
        slot_of, now = self._slot_of, self._now
        base = layer * self.num_experts
        keys = [base + e for e in experts]
        protected = set(keys)
        hits = 0
        for key in keys:
            slot = slot_of.get(key)
            if slot is not None:
                hits += 1
                policy.on_access(key, now)
                continue
            victim = None if part.free else policy.victim(protected)
            if victim is not None and not policy.admit(key, victim, now):
                continue
            if victim is None:
                slot = part.free.pop()
            else:
                slot = slot_of.pop(victim)
                policy.on_remove(victim)
            slot_of[key] = slot
            policy.on_insert(key, now)
        row = self._counts[phase][layer]
        row[0] += len(keys); row[1] += hits; row[2] += len(keys) - hits
        self._now = now + 1
        return None


class HeapPolicy(EvictionPolicy):
    """Evict min priority; priorities fixed between accesses (lazy heap)."""

    def __init__(self, capacity, **p):
        super().__init__(capacity)
        self.prio = {}   # resident key -> priority
        self.heap = []

    def _push(self, key, pr):
        self.prio[key] = pr
        heapq.heappush(self.heap, (pr, key))

    def on_remove(self, key):
        del self.prio[key]

    def victim(self, protected):
        heap, prio = self.heap, self.prio
        while heap and prio.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        if heap and heap[0][1] not in protected:
            return heap[0][1]
        held, found = [], None
        while heap:
            item = heapq.heappop(heap)
            if prio.get(item[1]) != item[0]:
                continue
            held.append(item)
            if item[1] not in protected:
                found = item[1]
                break
        for item in held:
            heapq.heappush(heap, item)
        return found


class BeladyBypass(HeapPolicy):
    needs_future = True

    def bind_future(self, f):
        self.f = f

    def _touch(self, key, now):
        self._push(key, -self.f.next_use(key, now))

    on_insert = on_access = _touch

    def admit(self, cand, victim, now):
        return self.f.next_use(cand, now) < -self.prio[victim]


class LRFU(HeapPolicy):
    """CRF = sum 2^(-lam*age); clock = accesses seen; lam = 1/(half * capacity)."""

    def __init__(self, capacity, half=1.0, bias=0.0, gate=True, **p):
        super().__init__(capacity)
        self.lam = 1.0 / (half * capacity)
        self.t = 0
        self.hist = {}   # key -> log-priority p (log2 crf + lam*t_last), kept after eviction
        self.bias, self.gate = bias, gate

    def _bump(self, key):
        self.t += 1
        lt = self.lam * self.t
        p = self.hist.get(key)
        p = lt if p is None else lt + math.log2(1.0 + 2.0 ** (p - lt))
        self.hist[key] = p
        return p

    def on_access(self, key, now):
        self._push(key, self._bump(key))

    def on_insert(self, key, now):
        if getattr(self, "_pending", None) == key:
            self._pending = None
            self._push(key, self.hist[key])
        else:
            self._push(key, self._bump(key))

    def admit(self, cand, victim, now):
        p = self._bump(cand)
        self._pending = cand
        return (not self.gate) or p + self.bias >= self.prio[victim]


def run(steps, L, E, k, slots, part, cls, **kw):
    table = RTable(L, E, slots, eviction="lru", partition=part, top_k=k)
    for pt in table._parts:
        pt.policy = cls(pt.capacity, **kw)
        if cls.needs_future:
            pt.policy.bind_future(Future([[l * E + e for e in ex] for l, ex in steps]))
    for layer, ex in steps:
        table.step(layer, ex)
    return table.stats().total().misses


if __name__ == "__main__":
    name, tokens = sys.argv[1], int(sys.argv[2])
    steps, L, E, k = steps_of(name, tokens)
    fut = Future([[layer * E + e for e in ex] for layer, ex in steps])
    from replay import replay
    configs = [(p, s) for p in ("global", "per-layer") for s in (768, 1536)]
    base = {c: replay(steps, L, E, k, c[1], c[0], "belady")[0] for c in configs}
    lru = {c: replay(steps, L, E, k, c[1], c[0], "lru")[0] for c in configs}
    def show(label, res):
        r = [res[c] / base[c] for c in configs]
        print(f"{label:40s}", " ".join(f"{x:.3f}" for x in r), f"avg {sum(r)/len(r):.3f}", flush=True)
    show("lru", lru)
    exec(sys.argv[3])
