"""Built-in policies read and driven through their compiled hooks (policies/kernels), the
only definition of their logic: for tests that trace a policy by hand.

``Compiled`` calls the hooks one at a time as the table's step does (protection is a
stamp equal to the asking step's number); ``lists``, ``slru_segment``, ``arc_lists`` and
``s3fifo_queues`` read a partition's state back in the shapes the traces are written in.
"""

from __future__ import annotations

import numpy as np

from expertcache.policies.kernels import kernel_module

NKEYS = 32  # keys 0..31: more than the hand traces use


class Compiled:
    """One partition of a built-in eviction policy, hook by hook."""

    def __init__(self, policy, nkeys: int = NKEYS, width: int = 4) -> None:
        while getattr(policy, "inner", None) is not None:
            policy = policy.inner  # a wrapper (static): its inner policy runs, as in SlotTable
        self.module = kernel_module(type(policy))
        self.st = self.module.state(policy, nkeys, 1, policy.capacity, width)
        self.stamp = np.full(nkeys, -1, np.int32)
        self.now = 0

    def on_insert(self, key, now):
        self.now = now
        self.module.on_insert(key, 0, now, -1, self.st)

    def on_access(self, key, now):
        self.now = now
        self.module.on_hit(key, 0, now, -1, self.st)

    def on_remove(self, key):
        self.module.on_evict(key, 0, self.st)

    def victim(self, protected):
        self.stamp[:] = -1
        self.stamp[list(protected)] = self.now
        v = self.module.find_victim(0, self.now, self.stamp, self.st)
        return None if v < 0 else int(v)


def lists(st, lid: int) -> list[int]:
    """List ``lid`` of a list-ordered state (policies/kernels/lists.py), oldest first."""
    nxt, head = st[1], st[2]
    out, k = [], int(head[lid])
    while k >= 0:
        out.append(k)
        k = int(nxt[k])
    return out


def slru_segment(st, key: int, p: int = 0) -> str | None:
    from expertcache.policies.kernels.slru import PROBATION, PROTECTED
    where = int(st[5][key])
    return {2 * p + PROBATION: "probation", 2 * p + PROTECTED: "protected"}.get(where)


def arc_lists(st, p: int = 0) -> tuple[dict[str, list[int]], float]:
    """``({"t1", "t2", "b1", "b2"}, p)``: ARC's lists and T1's target."""
    from expertcache.policies.kernels.arc import B1, B2, T1, T2
    named = {"t1": T1, "t2": T2, "b1": B1, "b2": B2}
    return {n: lists(st, 4 * p + i) for n, i in named.items()}, float(st[6][p])


def s3fifo_queues(st, p: int = 0) -> dict:
    """``{"small": {key: count}, "main": {key: count}, "ghost": [keys]}``, oldest first."""
    from expertcache.policies.kernels.s3fifo import GHOST, MAIN, SMALL
    freq = st[6]
    return {"small": {k: int(freq[k]) for k in lists(st, 3 * p + SMALL)},
            "main": {k: int(freq[k]) for k in lists(st, 3 * p + MAIN)},
            "ghost": lists(st, 3 * p + GHOST)}


def next_use_state(st, p: int = 0) -> dict:
    """A next-use state's learning, in the shapes the hand traces are written in:
    ``period``, ``seen``, ``hist[c][g]``, ``score[c][a]`` and per key ``(last, count,
    class)`` (policies/kernels/next_use.py ``state``)."""
    last, count, cls_of, period, seen, hist, score = st[6], st[7], st[8], st[9], st[11], st[12], st[13]
    return {"period": int(period[p]), "seen": int(seen[p]), "hist": hist[p].tolist(),
            "score": score[p].tolist(),
            "info": {k: (int(last[k]), float(count[k]), int(cls_of[k]))
                     for k in range(len(last)) if last[k] >= 0}}
