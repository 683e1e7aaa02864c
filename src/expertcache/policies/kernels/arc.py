"""Kernel of ``arc`` (policies/arc.py, with its adaptation to the step loop): T1, T2 and
the ghost lists B1, B2 per partition, and T1's target size ``p`` of each partition."""

from __future__ import annotations

import numpy as np
from numba import njit

from .lists import append, new_lists, oldest_unprotected, remove
from . import skeleton
from .skeleton import hook

T1, T2, B1, B2 = 0, 1, 2, 3   # list ``p * 4 + i``


def state(policy, nkeys: int, parts: int, cap: int, width: int) -> tuple:
    """Empty lists and T1 targets of 0 for ARC at ``cap`` slots per partition."""
    return (*new_lists(nkeys, 4 * parts), np.zeros(parts, np.float64), np.int64(cap))


@hook
def _trim(p, prev, nxt, head, tail, size, where, capacity):
    t1, t2, b1, b2 = 4 * p + T1, 4 * p + T2, 4 * p + B1, 4 * p + B2
    while size[b1] > 0 and size[t1] + size[b1] > capacity:
        remove(head[b1], b1, prev, nxt, head, tail, size, where)
    while size[b2] > 0 and size[t1] + size[t2] + size[b1] + size[b2] > 2 * capacity:
        remove(head[b2], b2, prev, nxt, head, tail, size, where)


@hook
def on_hit(key, p, s, j, st):  # to T2's end
    prev, nxt, head, tail, size, where, target, capacity = st
    remove(key, where[key], prev, nxt, head, tail, size, where)
    append(key, 4 * p + T2, prev, nxt, head, tail, size, where)


@hook
def find_victim(p, s, stamp, st):
    prev, nxt, head, tail, size, where, target, capacity = st
    t1, t2 = 4 * p + T1, 4 * p + T2
    first, second = (t1, t2) if size[t1] > target[p] else (t2, t1)
    victim = oldest_unprotected(first, head, nxt, stamp, s)
    if victim < 0:
        victim = oldest_unprotected(second, head, nxt, stamp, s)
    return victim


@hook
def on_evict(key, p, st):
    prev, nxt, head, tail, size, where, target, capacity = st
    # to the ghost list of the list it leaves, then trim
    ghost = 4 * p + (B1 if where[key] == 4 * p + T1 else B2)
    remove(key, where[key], prev, nxt, head, tail, size, where)
    append(key, ghost, prev, nxt, head, tail, size, where)
    _trim(p, prev, nxt, head, tail, size, where, capacity)


@hook
def on_insert(key, p, s, j, st):
    prev, nxt, head, tail, size, where, target, capacity = st
    t1, t2, b1, b2 = 4 * p + T1, 4 * p + T2, 4 * p + B1, 4 * p + B2
    lid = where[key]
    if lid == b1:    # T1 was too small
        target[p] = min(float(capacity), target[p] + max(size[b2] / size[b1], 1.0))
        remove(key, b1, prev, nxt, head, tail, size, where)
        append(key, t2, prev, nxt, head, tail, size, where)
    elif lid == b2:  # T2 was too small
        target[p] = max(0.0, target[p] - max(size[b1] / size[b2], 1.0))
        remove(key, b2, prev, nxt, head, tail, size, where)
        append(key, t2, prev, nxt, head, tail, size, where)
    else:
        append(key, t1, prev, nxt, head, tail, size, where)
    _trim(p, prev, nxt, head, tail, size, where, capacity)


# -- entry points: the shared step with this module's hooks (skeleton.py) --------------
@njit(cache=True, _nrt=False)
def replay(keys, phases, L, parts, cap, st, sc, adm):
    skeleton.replay(keys, phases, L, parts, cap, st, sc, adm, on_hit, find_victim, on_evict,
                    on_insert)


@njit(cache=True, _nrt=False)
def replay_log(keys, phases, L, parts, cap, st, sc, adm, log):
    skeleton.replay_log(keys, phases, L, parts, cap, st, sc, adm, log, on_hit, find_victim,
                        on_evict, on_insert)


@njit(cache=True, _nrt=False)
def step(row, s, layer, token, phase, p, cap, st, sc, adm):
    skeleton.step(row, s, layer, token, phase, p, cap, st, sc, adm, on_hit, find_victim,
                  on_evict, on_insert)


@njit(cache=True, _nrt=False)
def seed(keys, loaded, s, parts, num_experts, cap, st, sc):
    skeleton.seed(keys, loaded, s, parts, num_experts, cap, st, sc, on_insert)
