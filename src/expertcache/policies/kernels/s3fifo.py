"""Kernel of ``s3fifo`` (policies/s3fifo.py): the small queue S, the main queue M and the
ghost queue G as lists per partition; ``freq`` holds each resident key's hit count.

The victim search and the sweep that follows are fused: the table always removes the
victim it was just given, so the promotion decision found during the search (kept in
``promote``) is the one ``on_remove`` would recompute.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..s3fifo import MAX_FREQ
from .lists import append, new_lists, oldest_unprotected, remove
from . import skeleton
from .skeleton import hook

SMALL, MAIN, GHOST = 0, 1, 2   # list ``p * 3 + queue``


def state(policy, nkeys: int, parts: int, cap: int, width: int) -> tuple:
    """Empty queues for ``policy`` (an S3FIFO: its ``small_target``) at ``cap`` slots."""
    return (*new_lists(nkeys, 3 * parts), np.zeros(nkeys, np.int32), np.zeros(1, np.bool_),
            np.int64(cap), np.int64(policy.small_target))


@hook
def on_hit(key, p, s, j, st):
    prev, nxt, head, tail, size, where, freq, promote, capacity, target = st
    if freq[key] < MAX_FREQ:
        freq[key] += 1


@hook
def _main_victim(mq, head, nxt, freq, stamp, s):
    """First unprotected key of M with the lowest count (stops at the first count 0)."""
    best, best_count = -1, MAX_FREQ + 1
    k = head[mq]
    while k >= 0:
        if freq[k] < best_count and stamp[k] != s:
            best, best_count = k, freq[k]
            if best_count == 0:
                break
        k = nxt[k]
    return best


@hook
def _victim(p, s, stamp, nxt, head, size, freq, target):
    """``(victim or -1, promote)``: S3FIFO.victim, and whether on_remove promotes all of S."""
    sq, mq = 3 * p + SMALL, 3 * p + MAIN
    if size[sq] >= target or size[mq] == 0:  # the eviction works on S
        unhit = False
        k = head[sq]
        while k >= 0:
            if freq[k] == 0:
                if stamp[k] != s:
                    return k, False
                unhit = True
            k = nxt[k]
        if size[sq] > 0 and not unhit:
            found = _main_victim(mq, head, nxt, freq, stamp, s)
            if found >= 0 and freq[found] == 0:
                return found, True  # a count-0 key of M comes before the promoted ones
            promoted = oldest_unprotected(sq, head, nxt, stamp, s)
            return (found if promoted < 0 else promoted), True
    found = _main_victim(mq, head, nxt, freq, stamp, s)
    if found < 0:  # nothing evictable in M: S's oldest unprotected key
        found = oldest_unprotected(sq, head, nxt, stamp, s)
    return found, False


@hook
def find_victim(p, s, stamp, st):
    prev, nxt, head, tail, size, where, freq, promote, capacity, target = st
    victim, promote[0] = _victim(p, s, stamp, nxt, head, size, freq, target)
    return victim


@hook
def _sweep_main(victim, mq, prev, nxt, head, tail, size, where, freq):
    """The CLOCK sweep that stops at ``victim`` (count f): keys behind it lose f, keys in
    front lose f + 1 and go to the back in order, the victim leaves."""
    f = freq[victim]
    if f > 0:
        k = nxt[victim]
        while k >= 0:
            freq[k] = max(0, freq[k] - f)
            k = nxt[k]
    k = head[mq]
    while k != victim:
        after = nxt[k]
        freq[k] = max(0, freq[k] - f - 1)
        remove(k, mq, prev, nxt, head, tail, size, where)
        append(k, mq, prev, nxt, head, tail, size, where)
        k = after
    remove(victim, mq, prev, nxt, head, tail, size, where)


@hook
def on_evict(victim, p, st):
    prev, nxt, head, tail, size, where, freq, promote, capacity, target = st
    sq, mq, gq = 3 * p + SMALL, 3 * p + MAIN, 3 * p + GHOST
    if promote[0]:  # every key of S was hit: all of S to M (count 0), then M's sweep
        while head[sq] >= 0:
            k = head[sq]
            remove(k, sq, prev, nxt, head, tail, size, where)
            append(k, mq, prev, nxt, head, tail, size, where)
            freq[k] = 0
        _sweep_main(victim, mq, prev, nxt, head, tail, size, where, freq)
    elif where[victim] == sq:  # hit keys in front go to M, unhit ones stay
        k = head[sq]
        while k != victim:
            after = nxt[k]
            if freq[k] > 0:
                remove(k, sq, prev, nxt, head, tail, size, where)
                append(k, mq, prev, nxt, head, tail, size, where)
                freq[k] = 0
            k = after
        remove(victim, sq, prev, nxt, head, tail, size, where)
        append(victim, gq, prev, nxt, head, tail, size, where)
    else:
        _sweep_main(victim, mq, prev, nxt, head, tail, size, where, freq)


@hook
def on_insert(key, p, s, j, st):
    prev, nxt, head, tail, size, where, freq, promote, capacity, target = st
    # back from the ghost -> M, else S; then G is trimmed to capacity
    sq, mq, gq = 3 * p + SMALL, 3 * p + MAIN, 3 * p + GHOST
    if where[key] == gq:
        remove(key, gq, prev, nxt, head, tail, size, where)
        append(key, mq, prev, nxt, head, tail, size, where)
    else:
        append(key, sq, prev, nxt, head, tail, size, where)
    freq[key] = 0
    while size[gq] > capacity:
        remove(head[gq], gq, prev, nxt, head, tail, size, where)


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
