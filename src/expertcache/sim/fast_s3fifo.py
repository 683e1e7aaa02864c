"""Exact numba kernel for ``s3fifo`` (policies/s3fifo.py) under the SlotTable step loop.

Each partition owns three linked lists of keys, oldest first: the small queue S,
the main queue M and the ghost queue G (``fast_lists`` helpers; ``where[key]`` is
the list a key is in). ``freq`` holds each resident key's hit count (capped at 3).
The victim search and the sweep that follows are fused: the table always removes
the victim it was just given, so the promotion decision found during the search
is the one ``on_remove`` would recompute. tests/test_sim_fast.py holds it equal to
SlotTable on random and real traces; a change to the policy without this kernel
fails there.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .fast import _tally
from .fast_lists import _append, _oldest_unprotected, _remove

SMALL, MAIN, GHOST = 0, 1, 2
MAX_FREQ = 3  # policies.s3fifo.MAX_FREQ


@njit(cache=True)
def s3fifo_replay(keys, phases, L, E, parts, cap, target):
    """S3-FIFO at one capacity per partition; ``target`` is the policy's ``small_target``."""
    NL = 3
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    prev = np.full(nkeys, -1, np.int32)
    nxt = np.full(nkeys, -1, np.int32)
    where = np.full(nkeys, -1, np.int32)
    head = np.full(parts * NL, -1, np.int32)
    tail = np.full(parts * NL, -1, np.int32)
    size = np.zeros(parts * NL, np.int64)
    freq = np.zeros(nkeys, np.int32)
    stamp = np.full(nkeys, -1, np.int32)   # step that last needed the key = protected
    K = keys.shape[1]
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1   # s % L
        p = 0 if parts == 1 else layer
        sq, mq, gq = p * NL + SMALL, p * NL + MAIN, p * NL + GHOST
        row = keys[s]
        for j in range(K):
            if row[j] >= 0:
                stamp[row[j]] = s
        acc = hit = evict = bypass = 0
        for j in range(K):
            key = row[j]
            if key < 0:
                continue
            acc += 1
            lid = where[key]
            if lid == sq or lid == mq:  # hit: on_access
                hit += 1
                if freq[key] < MAX_FREQ:
                    freq[key] += 1
                continue
            if size[sq] + size[mq] == cap:
                victim, promote = _victim(sq, mq, head, nxt, freq, stamp, s, size, target)
                if victim < 0:
                    bypass += 1
                    continue
                # on_remove
                if promote:  # every key of S was hit: all of S to M (count 0), then M's sweep
                    while head[sq] >= 0:
                        k = head[sq]
                        _remove(k, sq, prev, nxt, head, tail, size, where)
                        _append(k, mq, prev, nxt, head, tail, size, where)
                        freq[k] = 0
                    _sweep_main(victim, mq, prev, nxt, head, tail, size, where, freq)
                elif where[victim] == sq:  # hit keys in front go to M, unhit ones stay
                    k = head[sq]
                    while k != victim:
                        after = nxt[k]
                        if freq[k] > 0:
                            _remove(k, sq, prev, nxt, head, tail, size, where)
                            _append(k, mq, prev, nxt, head, tail, size, where)
                            freq[k] = 0
                        k = after
                    _remove(victim, sq, prev, nxt, head, tail, size, where)
                    _append(victim, gq, prev, nxt, head, tail, size, where)
                else:
                    _sweep_main(victim, mq, prev, nxt, head, tail, size, where, freq)
                evict += 1
            # on_insert: back from the ghost -> M, else S; then G is trimmed to capacity
            if where[key] == gq:
                _remove(key, gq, prev, nxt, head, tail, size, where)
                _append(key, mq, prev, nxt, head, tail, size, where)
            else:
                _append(key, sq, prev, nxt, head, tail, size, where)
            freq[key] = 0
            while size[gq] > cap:
                _remove(head[gq], gq, prev, nxt, head, tail, size, where)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=True, inline="always")
def _victim(sq, mq, head, nxt, freq, stamp, s, size, target):
    """``(victim or -1, promote)``: S3FIFO.victim, and whether on_remove promotes all of S."""
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
            promoted = _oldest_unprotected(sq, head, nxt, stamp, s)
            return (found if promoted < 0 else promoted), True
    found = _main_victim(mq, head, nxt, freq, stamp, s)
    if found < 0:  # nothing evictable in M: S's oldest unprotected key
        found = _oldest_unprotected(sq, head, nxt, stamp, s)
    return found, False


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
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
        _remove(k, mq, prev, nxt, head, tail, size, where)
        _append(k, mq, prev, nxt, head, tail, size, where)
        k = after
    _remove(victim, mq, prev, nxt, head, tail, size, where)
