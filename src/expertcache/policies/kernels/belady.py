"""Kernel of ``belady`` (policies/belady.py): Belady's MIN with forced admission.

A min-heap per partition holds each resident key under ``-(next use << 21 | (2**21 - 1
- key))``: the farthest next use first, then the smaller key, so ties always break the
same way. A hit re-keys the entry in place. The future is ``Future.arrays``: every key's
use steps in order (``starts``/``uses``, a CSR table) and a cursor per key that only
moves forward, as steps do; and, from the simulator, each access's next use in the
layout of its rows (``nexts``), read in order when the step's key sits in that column
(a search of ``uses`` per access made the replay 30% slower).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..belady import NEVER
from . import heap, skeleton
from .skeleton import hook

KEY_BITS = 21                            # keys < 2**21 (checked by ``fits``)
_KEY_MASK = (1 << KEY_BITS) - 1
_STEP_MAX = (1 << (62 - KEY_BITS)) - 1   # stands for NEVER; real steps stay far below
NEVER32 = np.iinfo(np.int32).max         # NEVER in ``nexts`` (int32: half the memory to fill)


def fits(prep) -> bool:
    return prep.L * prep.E < (1 << KEY_BITS)


def state(policy, nkeys: int, parts: int, cap: int, width: int) -> tuple:
    """Empty heaps at ``cap`` slots per partition, and ``policy``'s bound future. With
    ``policy.ties_by_future`` (set for admission ``oracle``), keys needed at the same next
    step are told apart by their later uses (``_latest_tie``)."""
    starts, uses, rows, nexts = policy.future_arrays(nkeys)
    ties = np.empty(4 * width + 8 if getattr(policy, "ties_by_future", False) else 0, np.int64)
    return (*heap.new_heap(nkeys, parts, cap, width), starts, uses,
            starts[:-1].copy(), rows, nexts, np.int64(cap), ties)


@njit(cache=True)
def future_from_keys(keys, nkeys):
    """``(starts, uses, nexts)`` of step keys ``[S, W]``: the steps using each key, in
    order (a CSR table), and each access's next use (``int32 [S, W]``, or NEVER32; steps
    fit: ``replay`` refuses traces of 2**31 steps)."""
    starts = np.zeros(nkeys + 1, np.int64)
    nexts = np.full(keys.shape, NEVER32, np.int32)
    seen = np.full(nkeys, NEVER32, np.int32)
    for s in range(keys.shape[0] - 1, -1, -1):   # backwards: next uses, and use counts
        for j in range(keys.shape[1]):
            key = keys[s, j]
            if key >= 0:
                nexts[s, j] = seen[key]
                seen[key] = s
                starts[key + 1] += 1
    for k in range(nkeys):
        starts[k + 1] += starts[k]
    fill = starts[:-1].copy()
    uses = np.empty(starts[nkeys], np.int64)
    for s in range(keys.shape[0]):
        for j in range(keys.shape[1]):
            key = keys[s, j]
            if key >= 0:
                uses[fill[key]] = s
                fill[key] += 1
    return starts, uses, nexts


@hook
def _prio(key, s, j, starts, uses, cursor, rows, nexts):
    """The heap priority of ``key`` at step ``s`` (column ``j`` of its row, -1 outside a
    step): its next use after ``s``, farthest first."""
    if j >= 0 and s < rows.shape[0] and rows[s, j] == key:
        next_use = NEVER if nexts[s, j] == NEVER32 else np.int64(nexts[s, j])
    else:
        i, end = cursor[key], starts[key + 1]
        while i < end and uses[i] <= s:
            i += 1
        cursor[key] = i
        next_use = uses[i] if i < end else NEVER
    return -((min(next_use, _STEP_MAX) << KEY_BITS) | (_KEY_MASK - key))


@hook
def on_hit(key, p, s, j, st):
    prio, hkey, where, size, todo, starts, uses, cursor, rows, nexts, capacity, ties = st
    i = where[key]
    prio[p * capacity + i] = _prio(key, s, j, starts, uses, cursor, rows, nexts)  # can only rise
    heap.up(prio, hkey, where, p * capacity, i)


@hook
def find_victim(p, s, stamp, st):
    prio, hkey, where, size, todo, starts, uses, cursor, rows, nexts, capacity, ties = st
    victim = heap.min_unprotected(prio, hkey, stamp, s, p * capacity, size[p], todo)
    if ties.shape[0] == 0 or victim < 0:
        return victim
    return _latest_tie(victim, prio, hkey, where, stamp, s, p * capacity, size[p], ties, starts,
                       uses, cursor)


@hook
def _latest_tie(victim, prio, hkey, where, stamp, s, base, n, todo, starts, uses, cursor):
    """Of the unprotected keys needed at the same step as ``victim``, the one whose later uses
    come last (first differing use; none left = latest). A step needs many keys at once, so
    next uses tie, and MIN with bypass is exact only with this order (tests/
    test_oracle_bruteforce.py). They sit at the top of the heap, above every key needed sooner,
    with at most one step's keys (protected, or the tie group) among them: a short search."""
    top_nu = prio[base + where[victim]] >> KEY_BITS
    if -top_nu - 1 >= _STEP_MAX:           # never used again: all alike
        return victim
    best, top = victim, 1
    todo[0] = 0
    while top > 0:
        top -= 1
        i = todo[top]
        if i >= n or prio[base + i] >> KEY_BITS > top_nu:
            continue                       # needed sooner: so is all below it
        key = hkey[base + i]
        if stamp[key] != s and key != best and prio[base + i] >> KEY_BITS == top_nu \
                and _later(key, best, s, starts, uses, cursor):
            best = key
        todo[top] = 2 * i + 1   # visited: at most 2 x width entries, so todo holds them
        todo[top + 1] = 2 * i + 2
        top += 2
    return best


@hook
def _later(a, b, s, starts, uses, cursor):
    """Whether ``a``'s uses after step ``s`` come later than ``b``'s (first difference)."""
    return skeleton.uses_later(uses, _cursor(a, s, starts, uses, cursor), _cursor(b, s, starts, uses, cursor),
                               starts[a + 1], starts[b + 1])


@hook
def _cursor(key, s, starts, uses, cursor):
    i, end = cursor[key], starts[key + 1]
    while i < end and uses[i] <= s:
        i += 1
    cursor[key] = i
    return i


@hook
def on_evict(key, p, st):
    prio, hkey, where, size, todo, starts, uses, cursor, rows, nexts, capacity, ties = st
    heap.remove(prio, hkey, where, size, p, p * capacity, key)


@hook
def on_insert(key, p, s, j, st):
    prio, hkey, where, size, todo, starts, uses, cursor, rows, nexts, capacity, ties = st
    prio_key = _prio(key, s, j, starts, uses, cursor, rows, nexts)
    heap.push(prio, hkey, where, size, p, p * capacity, key, prio_key)


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
