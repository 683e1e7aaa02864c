"""Exact numba kernels for ``slru``, ``arc`` (linked lists) and ``lfu`` (a heap).

They mirror policies/slru.py, arc.py and lfu.py call for call under the
SlotTable's step loop (forced admission, no pins), so sweeps over them need no
Python replay; tests/test_sim_fast.py holds them equal to SlotTable on random
and real traces, which is also what catches a policy changed without its kernel.

Every partition owns ``NL`` doubly linked lists of keys (oldest first); a key
sits in at most one list (``where[key]``, -1 none). List ``lid = p * NL + i``.
Counts come back as ``int64 [2, L, 6]`` like ``sim.fast``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .fast import _tally

# list ids within a partition
PROBATION, PROTECTED = 0, 1          # slru
T1, T2, B1, B2 = 0, 1, 2, 3          # arc


@njit(cache=True, inline="always")
def _remove(key, lid, prev, nxt, head, tail, size, where):
    a, b = prev[key], nxt[key]
    if a >= 0:
        nxt[a] = b
    else:
        head[lid] = b
    if b >= 0:
        prev[b] = a
    else:
        tail[lid] = a
    size[lid] -= 1
    where[key] = -1


@njit(cache=True, inline="always")
def _append(key, lid, prev, nxt, head, tail, size, where):
    t = tail[lid]
    prev[key], nxt[key] = t, -1
    if t >= 0:
        nxt[t] = key
    else:
        head[lid] = key
    tail[lid] = key
    size[lid] += 1
    where[key] = lid


@njit(cache=True, inline="always")
def _oldest_unprotected(lid, head, nxt, stamp, s):
    key = head[lid]
    while key >= 0 and stamp[key] == s:
        key = nxt[key]
    return key


@njit(cache=True)
def slru_replay(keys, phases, L, E, parts, cap, protected_cap):
    """Segmented LRU (policies/slru.py) at one capacity per partition."""
    NL = 2
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    prev = np.full(nkeys, -1, np.int32)
    nxt = np.full(nkeys, -1, np.int32)
    where = np.full(nkeys, -1, np.int32)
    head = np.full(parts * NL, -1, np.int32)
    tail = np.full(parts * NL, -1, np.int32)
    size = np.zeros(parts * NL, np.int64)
    stamp = np.full(nkeys, -1, np.int32)
    K = keys.shape[1]
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1
        p = 0 if parts == 1 else layer
        prob, prot = p * NL + PROBATION, p * NL + PROTECTED
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
            if where[key] >= 0:  # hit: on_access
                hit += 1
                lid = where[key]
                _remove(key, lid, prev, nxt, head, tail, size, where)
                _append(key, prot, prev, nxt, head, tail, size, where)
                if lid == prob and size[prot] > protected_cap:  # demote the oldest protected
                    old = head[prot]
                    _remove(old, prot, prev, nxt, head, tail, size, where)
                    _append(old, prob, prev, nxt, head, tail, size, where)
                continue
            if size[prob] + size[prot] == cap:
                victim = _oldest_unprotected(prob, head, nxt, stamp, s)
                if victim < 0:
                    victim = _oldest_unprotected(prot, head, nxt, stamp, s)
                if victim < 0:
                    bypass += 1
                    continue
                _remove(victim, where[victim], prev, nxt, head, tail, size, where)
                evict += 1
            _append(key, prob, prev, nxt, head, tail, size, where)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=True)
def arc_replay(keys, phases, L, E, parts, cap):
    """ARC (policies/arc.py, with its adaptation to the step loop) per partition."""
    NL = 4
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    prev = np.full(nkeys, -1, np.int32)
    nxt = np.full(nkeys, -1, np.int32)
    where = np.full(nkeys, -1, np.int32)
    head = np.full(parts * NL, -1, np.int32)
    tail = np.full(parts * NL, -1, np.int32)
    size = np.zeros(parts * NL, np.int64)
    target = np.zeros(parts, np.float64)   # ARC's p: the target size of T1
    stamp = np.full(nkeys, -1, np.int32)
    K = keys.shape[1]
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1
        p = 0 if parts == 1 else layer
        t1, t2, b1, b2 = p * NL + T1, p * NL + T2, p * NL + B1, p * NL + B2
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
            if lid == t1 or lid == t2:  # hit: on_access moves it to T2's recent end
                hit += 1
                _remove(key, lid, prev, nxt, head, tail, size, where)
                _append(key, t2, prev, nxt, head, tail, size, where)
                continue
            if size[t1] + size[t2] == cap:
                first, second = (t1, t2) if size[t1] > target[p] else (t2, t1)
                victim = _oldest_unprotected(first, head, nxt, stamp, s)
                if victim < 0:
                    victim = _oldest_unprotected(second, head, nxt, stamp, s)
                if victim < 0:
                    bypass += 1
                    continue
                # on_remove: to the ghost list of the list it leaves, then trim
                ghost = b1 if where[victim] == t1 else b2
                _remove(victim, where[victim], prev, nxt, head, tail, size, where)
                _append(victim, ghost, prev, nxt, head, tail, size, where)
                _arc_trim(t1, t2, b1, b2, cap, prev, nxt, head, tail, size, where)
                evict += 1
                lid = where[key]  # the trim may have dropped the key's own ghost
            # on_insert
            if lid == b1:
                target[p] = min(float(cap), target[p] + max(size[b2] / size[b1], 1.0))
                _remove(key, b1, prev, nxt, head, tail, size, where)
                _append(key, t2, prev, nxt, head, tail, size, where)
            elif lid == b2:
                target[p] = max(0.0, target[p] - max(size[b1] / size[b2], 1.0))
                _remove(key, b2, prev, nxt, head, tail, size, where)
                _append(key, t2, prev, nxt, head, tail, size, where)
            else:
                _append(key, t1, prev, nxt, head, tail, size, where)
            _arc_trim(t1, t2, b1, b2, cap, prev, nxt, head, tail, size, where)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=True, inline="always")
def _arc_trim(t1, t2, b1, b2, cap, prev, nxt, head, tail, size, where):
    while size[b1] > 0 and size[t1] + size[b1] > cap:
        _remove(head[b1], b1, prev, nxt, head, tail, size, where)
    while size[b2] > 0 and size[t1] + size[t2] + size[b1] + size[b2] > 2 * cap:
        _remove(head[b2], b2, prev, nxt, head, tail, size, where)


# -- lfu: an indexed min-heap per partition ---------------------------------------
TICK_BITS = 36  # lfu packs (count, tick) into one int64: ticks < 2**36, counts < 2**27
_TICK_MASK = (1 << TICK_BITS) - 1


@njit(cache=True)
def lfu_replay(keys, phases, L, E, parts, cap, decay):
    """LFU with aging (policies/lfu.py) at one capacity per partition.

    Residents sit in a min-heap of ``count << 36 | tick`` (fewest uses first,
    then least recently touched), with ``where[key]`` their heap index and
    ``heap_key`` the key of each heap entry. Every ``decay`` touches of a
    partition all its counts halve, which can reorder ties: the heap is rebuilt.
    """
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    heap = np.empty(parts * cap, np.int64)
    heap_key = np.empty(parts * cap, np.int32)
    size = np.zeros(parts, np.int64)
    ticks = np.zeros(parts, np.int64)
    where = np.full(nkeys, -1, np.int32)
    stamp = np.full(nkeys, -1, np.int32)
    K = keys.shape[1]
    todo = np.empty(2 * K + 3, np.int64)
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1
        p = 0 if parts == 1 else layer
        base = p * cap
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
            i = where[key]
            ticks[p] += 1
            if i >= 0:  # hit: count + 1, touched now: can only sink
                hit += 1
                count = heap[base + i] >> TICK_BITS
                heap[base + i] = ((count + 1) << TICK_BITS) | ticks[p]
                _down(heap, heap_key, where, base, size[p], i)
            else:
                n = size[p]
                if n == cap:
                    v = _min_unprotected(heap, heap_key, stamp, s, base, n, todo)
                    if v < 0:
                        bypass += 1
                        ticks[p] -= 1  # no touch happened
                        continue
                    where[heap_key[base + v]] = -1
                    n -= 1
                    if v != n:
                        heap[base + v], heap_key[base + v] = heap[base + n], heap_key[base + n]
                        where[heap_key[base + v]] = v
                        _down(heap, heap_key, where, base, n, v)
                        _up(heap, heap_key, where, base, v)
                    evict += 1
                heap[base + n], heap_key[base + n] = (1 << TICK_BITS) | ticks[p], key
                where[key] = n
                size[p] = n + 1
                _up(heap, heap_key, where, base, n)
            if ticks[p] % decay == 0:  # age: halve every count, keep ticks, re-heap
                for q in range(size[p]):
                    e = heap[base + q]
                    heap[base + q] = ((e >> TICK_BITS) >> 1 << TICK_BITS) | (e & _TICK_MASK)
                for q in range(size[p] // 2 - 1, -1, -1):
                    _down(heap, heap_key, where, base, size[p], q)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=True)
def _up(heap, heap_key, where, base, i):
    x, xk = heap[base + i], heap_key[base + i]
    while i > 0:
        parent = (i - 1) >> 1
        if heap[base + parent] <= x:
            break
        heap[base + i], heap_key[base + i] = heap[base + parent], heap_key[base + parent]
        where[heap_key[base + i]] = i
        i = parent
    heap[base + i], heap_key[base + i] = x, xk
    where[xk] = i


@njit(cache=True)
def _down(heap, heap_key, where, base, n, i):
    x, xk = heap[base + i], heap_key[base + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and heap[base + c + 1] < heap[base + c]:
            c += 1
        if heap[base + c] >= x:
            break
        heap[base + i], heap_key[base + i] = heap[base + c], heap_key[base + c]
        where[heap_key[base + i]] = i
        i = c
    heap[base + i], heap_key[base + i] = x, xk
    where[xk] = i


@njit(cache=True)
def _min_unprotected(heap, heap_key, stamp, s, base, n, todo):
    """Heap index of the smallest entry whose key the step does not need, or -1."""
    best, top = -1, 1
    todo[0] = 0
    while top > 0:
        top -= 1
        i = todo[top]
        if i >= n:
            continue
        if stamp[heap_key[base + i]] != s:
            if best < 0 or heap[base + i] < heap[base + best]:
                best = i
            continue
        todo[top] = 2 * i + 1
        todo[top + 1] = 2 * i + 2
        top += 2
    return best
