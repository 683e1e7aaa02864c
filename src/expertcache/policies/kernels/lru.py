"""Kernel of ``lru`` and ``fifo`` (policies/lru.py, fifo.py): one list per partition,
oldest first; a hit moves its key to the recent end unless the policy is FIFO."""

from __future__ import annotations

import numpy as np
from numba import njit

from . import skeleton
from .skeleton import hook


def state(policy, nkeys: int, parts: int, cap: int, width: int) -> tuple:
    """Empty lists for ``policy`` (an LRU or FIFO: its ``reorders``)."""
    return (np.full(nkeys, -1, np.int32), np.full(nkeys, -1, np.int32),   # links, oldest first
            np.full(parts, -1, np.int32), np.full(parts, -1, np.int32),   # head, tail per partition
            np.array([policy.reorders]))                                  # FIFO: hits do not reorder


# One list per partition, written out here rather than with lists.py's helpers: this is
# the hottest kernel, and it keeps neither sizes nor list ids.
@hook
def on_hit(key, p, s, j, st):
    prev, nxt, head, tail, recency = st
    if recency[0] and tail[p] != key:  # LRU: to the recent end (the key has a successor)
        a, b = prev[key], nxt[key]
        if a >= 0:
            nxt[a] = b
        else:
            head[p] = b
        prev[b] = a
        t = tail[p]
        prev[key], nxt[key], nxt[t], tail[p] = t, -1, key, key


@hook
def find_victim(p, s, stamp, st):
    prev, nxt, head, tail, recency = st
    key = head[p]
    while key >= 0 and stamp[key] == s:
        key = nxt[key]
    return key


@hook
def on_evict(key, p, st):
    prev, nxt, head, tail, recency = st
    a, b = prev[key], nxt[key]
    if a >= 0:
        nxt[a] = b
    else:
        head[p] = b
    if b >= 0:
        prev[b] = a
    else:
        tail[p] = a


@hook
def on_insert(key, p, s, j, st):
    prev, nxt, head, tail, recency = st
    t = tail[p]
    prev[key], nxt[key] = t, -1
    if t >= 0:
        nxt[t] = key
    else:
        head[p] = key
    tail[p] = key


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
