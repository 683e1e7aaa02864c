"""Kernel of ``lfu`` (policies/lfu.py): LFU with aging, an indexed min-heap per partition.

Residents sit in the heap under ``count << 36 | tick`` (fewest uses first, then least
recently touched). Every ``decay`` touches of a partition all its counts halve, which
can reorder ties: the heap is rebuilt.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import heap, skeleton
from .skeleton import hook

TICK_BITS = 36  # (count, tick) share one int64: ticks < 2**36, counts < 2**27 (``fits``)
_TICK_MASK = (1 << TICK_BITS) - 1


def fits(prep) -> bool:
    return prep.trace.experts.size < (1 << 27)


def state(policy, nkeys: int, parts: int, cap: int, width: int) -> tuple:
    """Empty heaps for ``policy`` (an LFU: its ``decay``) at ``cap`` slots per partition."""
    return (*heap.new_heap(nkeys, parts, cap, width), np.zeros(parts, np.int64), np.int64(cap),
            np.int64(policy.decay))




@hook
def _touched(p, prio, hkey, where, size, ticks, capacity, decay):
    """One more touch of partition ``p``; every ``decay`` touches all counts halve."""
    if ticks[p] % decay == 0:
        base = p * capacity
        for q in range(size[p]):
            e = prio[base + q]
            prio[base + q] = ((e >> TICK_BITS) >> 1 << TICK_BITS) | (e & _TICK_MASK)
        for q in range(size[p] // 2 - 1, -1, -1):
            heap.down(prio, hkey, where, base, size[p], q)


@hook
def on_hit(key, p, s, j, st):
    prio, hkey, where, size, todo, ticks, capacity, decay = st
    ticks[p] += 1
    i, base = where[key], p * capacity
    count = prio[base + i] >> TICK_BITS
    prio[base + i] = ((count + 1) << TICK_BITS) | ticks[p]   # count + 1, touched now: sinks
    heap.down(prio, hkey, where, base, size[p], i)
    _touched(p, prio, hkey, where, size, ticks, capacity, decay)


@hook
def find_victim(p, s, stamp, st):
    prio, hkey, where, size, todo, ticks, capacity, decay = st
    return heap.min_unprotected(prio, hkey, stamp, s, p * capacity, size[p], todo)


@hook
def on_evict(key, p, st):
    prio, hkey, where, size, todo, ticks, capacity, decay = st
    heap.remove(prio, hkey, where, size, p, p * capacity, key)


@hook
def on_insert(key, p, s, j, st):
    prio, hkey, where, size, todo, ticks, capacity, decay = st
    ticks[p] += 1
    heap.push(prio, hkey, where, size, p, p * capacity, key, (1 << TICK_BITS) | ticks[p])
    _touched(p, prio, hkey, where, size, ticks, capacity, decay)


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
