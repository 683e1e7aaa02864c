"""Kernel of ``slru`` (policies/slru.py): probation and protected lists per partition."""

from __future__ import annotations

import numpy as np

from .lists import append, new_lists, oldest_unprotected, remove
from . import skeleton
from .skeleton import hook, specialize

PROBATION, PROTECTED = 0, 1   # list ``p * 2 + segment``


def run(prep, policy, parts: int, cap: int, admission: tuple) -> np.ndarray:
    """Counts ``[2, L, 6]`` of ``policy`` (an SLRU; its ``protected_cap``) at ``cap`` slots."""
    st = (*new_lists(prep.L * prep.E, 2 * parts), np.int64(policy.protected_cap))
    return skeleton.run(replay, prep, parts, cap, st, admission)


STATE = ("prev", "nxt", "head", "tail", "size", "where", "protected_cap")


@hook
def on_hit(key, p, s, j, prev, nxt, head, tail, size, where, protected_cap):
    prob, prot = 2 * p + PROBATION, 2 * p + PROTECTED
    lid = where[key]
    remove(key, lid, prev, nxt, head, tail, size, where)
    append(key, prot, prev, nxt, head, tail, size, where)
    if lid == prob and size[prot] > protected_cap:  # demote the oldest protected
        old = head[prot]
        remove(old, prot, prev, nxt, head, tail, size, where)
        append(old, prob, prev, nxt, head, tail, size, where)


@hook
def find_victim(p, s, stamp, prev, nxt, head, tail, size, where, protected_cap):
    victim = oldest_unprotected(2 * p + PROBATION, head, nxt, stamp, s)
    if victim < 0:
        victim = oldest_unprotected(2 * p + PROTECTED, head, nxt, stamp, s)
    return victim


@hook
def on_evict(key, p, prev, nxt, head, tail, size, where, protected_cap):
    remove(key, where[key], prev, nxt, head, tail, size, where)


@hook
def on_insert(key, p, s, j, prev, nxt, head, tail, size, where, protected_cap):
    append(key, 2 * p + PROBATION, prev, nxt, head, tail, size, where)


replay = specialize(globals(), "slru_replay")
