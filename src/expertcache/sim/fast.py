"""Exact numba kernels for the policies that dominate sweeps: lru, fifo, belady.

Each kernel reproduces ``SlotTable`` with forced admission ("always"), no pinned
or seeded keys, step by step: the same hits, misses, loads, evictions and
bypasses per layer and phase (tests/test_sim_fast.py compares them on random
and real traces). Keys are ints ``layer * E + expert``; steps run token-major.

Counts come back as ``int64 [2, L, 6]`` (phase, layer, ``stats.FIELDS``), the
raw layout ``stats.Stats`` wraps.

Why one pass gives LRU at every capacity: under step protection the victim is
always the least recent key *outside* the step, and every key of a step ends
at the recent end in rank order. By induction a full cache then holds exactly
the ``C`` most recently used keys (recency = position in the flattened access
sequence), so a key is a hit iff fewer than ``C`` distinct keys were used
between its last use and the *start* of its step. The kernel measures that
distance for every access (Fenwick tree over positions, queries before the
step's updates), and a histogram answers every capacity at once.
"""

from __future__ import annotations

import numpy as np
from numba import njit

NEVER = 1 << 62  # "not used again", as in policies.belady
_ACC, _HIT, _MISS, _LOAD, _EVICT, _BYPASS = range(6)


# -- preparation (numpy) ------------------------------------------------------
def step_keys(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Token-major step keys: ``int32 [T*L, K]``, duplicates within a step as -1.

    ``experts`` is ``int16 [L, T, K]``; step ``s = t*L + l`` needs ``keys[s]``.
    """
    L, T, K = experts.shape
    keys = experts.transpose(1, 0, 2).astype(np.int32)            # T, L, K
    keys += (np.arange(L, dtype=np.int32) * num_experts)[None, :, None]
    keys = keys.reshape(T * L, K)
    _dedupe(keys)
    return keys


@njit(cache=True)
def _dedupe(keys):
    # SlotTable.step keeps the first of repeated experts (dict.fromkeys).
    for s in range(keys.shape[0]):
        for j in range(1, keys.shape[1]):
            for i in range(j):
                if keys[s, i] == keys[s, j]:
                    keys[s, j] = -1
                    break


def step_phases(phase: np.ndarray, num_layers: int) -> np.ndarray:
    """``uint8 [T*L]``: each step's phase (the phase of its token)."""
    return np.repeat(np.asarray(phase, dtype=np.uint8), num_layers)


# -- LRU / FIFO at one capacity ------------------------------------------------
@njit(cache=True)
def list_replay(keys, phases, L, E, parts, cap, lru):
    """LRU (``lru=True``) or FIFO at one capacity per partition.

    ``parts`` is 1 (global pool) or L (one partition per layer). A doubly
    linked list per partition keeps insertion / recency order, oldest first.
    """
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    prev = np.full(nkeys, -1, np.int64)
    nxt = np.full(nkeys, -1, np.int64)
    head = np.full(parts, -1, np.int64)
    tail = np.full(parts, -1, np.int64)
    used = np.zeros(parts, np.int64)
    resident = np.zeros(nkeys, np.bool_)
    stamp = np.full(nkeys, -1, np.int64)  # step that last needed the key = protected
    K = keys.shape[1]
    for s in range(keys.shape[0]):
        layer = s % L
        p = 0 if parts == 1 else layer
        ph = phases[s]
        for j in range(K):
            if keys[s, j] >= 0:
                stamp[keys[s, j]] = s
        for j in range(K):
            key = keys[s, j]
            if key < 0:
                continue
            counts[ph, layer, _ACC] += 1
            if resident[key]:
                counts[ph, layer, _HIT] += 1
                if lru and tail[p] != key:  # move to the recent end
                    _unlink(key, p, prev, nxt, head, tail)
                    _append(key, p, prev, nxt, head, tail)
                continue
            counts[ph, layer, _MISS] += 1
            if used[p] < cap:
                used[p] += 1
            else:
                victim = head[p]
                while victim >= 0 and stamp[victim] == s:
                    victim = nxt[victim]
                if victim < 0:  # everything resident is protected
                    counts[ph, layer, _BYPASS] += 1
                    continue
                _unlink(victim, p, prev, nxt, head, tail)
                resident[victim] = False
                counts[ph, layer, _EVICT] += 1
            _append(key, p, prev, nxt, head, tail)
            resident[key] = True
            counts[ph, layer, _LOAD] += 1
    return counts


@njit(cache=True)
def _unlink(key, p, prev, nxt, head, tail):
    a, b = prev[key], nxt[key]
    if a >= 0:
        nxt[a] = b
    else:
        head[p] = b
    if b >= 0:
        prev[b] = a
    else:
        tail[p] = a
    prev[key] = -1
    nxt[key] = -1


@njit(cache=True)
def _append(key, p, prev, nxt, head, tail):
    t = tail[p]
    prev[key] = t
    nxt[key] = -1
    if t >= 0:
        nxt[t] = key
    else:
        head[p] = key
    tail[p] = key


# -- LRU at every capacity (stack distances) ----------------------------------
@njit(cache=True)
def lru_distances(keys, phases, L, E, parts):
    """Histogram of step-start LRU stack distances, and the cold-miss sequence.

    Returns ``hist int64 [2, L, D+1]`` (D = keys per partition; a hit at
    capacity C iff distance < C), ``cold_counts [2, L]`` (first uses), and for
    every first use in order: its rank within its partition, phase and layer
    (to tell fill-ups from evictions at each capacity).
    """
    nkeys = L * E
    D = nkeys if parts == 1 else E
    per_part = (keys.shape[0] * keys.shape[1]) // parts + keys.shape[1] + 1
    tree = np.zeros(parts * (per_part + 1), np.int64)  # one Fenwick tree per partition
    pos = np.zeros(parts, np.int64)       # last position handed out per partition
    distinct = np.zeros(parts, np.int64)  # keys seen per partition
    last = np.zeros(nkeys, np.int64)      # 1-based position of a key's last use, 0 = never
    hist = np.zeros((2, L, D + 1), np.int64)
    cold_rank = np.empty(nkeys, np.int64)
    cold_phase = np.empty(nkeys, np.uint8)
    cold_layer = np.empty(nkeys, np.int64)
    ncold = 0
    K = keys.shape[1]
    for s in range(keys.shape[0]):
        layer = s % L
        p = 0 if parts == 1 else layer
        base = p * (per_part + 1)
        ph = phases[s]
        # Queries first: a hit means resident when the step begins.
        marked = distinct[p]  # keys with a mark in the tree at step start
        for j in range(K):
            key = keys[s, j]
            if key < 0:
                continue
            if last[key] == 0:
                cold_rank[ncold] = distinct[p]
                cold_phase[ncold] = ph
                cold_layer[ncold] = layer
                ncold += 1
                distinct[p] += 1
            else:
                d = marked - _prefix(tree, base, last[key])
                hist[ph, layer, d] += 1
        for j in range(K):
            key = keys[s, j]
            if key < 0:
                continue
            if last[key] != 0:
                _add(tree, base, per_part, last[key], -1)
            pos[p] += 1
            _add(tree, base, per_part, pos[p], 1)
            last[key] = pos[p]
    return hist, cold_rank[:ncold], cold_phase[:ncold], cold_layer[:ncold]


@njit(cache=True)
def _prefix(tree, base, i):
    total = 0
    while i > 0:
        total += tree[base + i]
        i -= i & -i
    return total


@njit(cache=True)
def _add(tree, base, n, i, v):
    while i <= n:
        tree[base + i] += v
        i += i & -i


def lru_counts_at(dist, capacity: int, parts: int) -> np.ndarray:
    """Counts ``[2, L, 6]`` at one per-partition capacity from ``lru_distances``."""
    hist, cold_rank, cold_phase, cold_layer = dist
    L = hist.shape[1]
    hits = hist[:, :, :capacity].sum(axis=2)
    accesses = hist.sum(axis=2) + _bincount(cold_phase, cold_layer, np.ones(len(cold_rank), bool), L)
    fill = _bincount(cold_phase, cold_layer, cold_rank < capacity, L)
    counts = np.zeros((2, L, 6), np.int64)
    counts[..., _ACC] = accesses
    counts[..., _HIT] = hits
    counts[..., _MISS] = accesses - hits
    counts[..., _LOAD] = accesses - hits
    counts[..., _EVICT] = accesses - hits - fill
    return counts


def _bincount(phase, layer, mask, L):
    idx = phase[mask].astype(np.int64) * L + layer[mask]
    return np.bincount(idx, minlength=2 * L).reshape(2, L)


# -- Belady at one capacity -----------------------------------------------------
def next_uses(keys: np.ndarray) -> np.ndarray:
    """``int64 [T*L, K]``: the next step needing each access's key, or NEVER."""
    return _next_uses(keys, int(keys.max()) + 1 if keys.size else 1)


@njit(cache=True)
def _next_uses(keys, nkeys):
    out = np.full(keys.shape, NEVER, np.int64)
    seen = np.full(nkeys, NEVER, np.int64)
    for s in range(keys.shape[0] - 1, -1, -1):
        for j in range(keys.shape[1]):
            key = keys[s, j]
            if key >= 0:
                out[s, j] = seen[key]
                seen[key] = s
    return out


@njit(cache=True)
def belady_replay(keys, nexts, phases, L, E, parts, cap):
    """Belady's MIN (forced admission) at one capacity per partition.

    An indexed max-heap per partition orders residents by (next use desc, key
    asc), the order policies.belady's heap pops in, so ties break the same way.
    """
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    hkey = np.empty(parts * cap, np.int64)
    hval = np.empty(parts * cap, np.int64)
    size = np.zeros(parts, np.int64)
    where = np.full(nkeys, -1, np.int64)   # heap index of a resident key, -1 = absent
    stamp = np.full(nkeys, -1, np.int64)
    K = keys.shape[1]
    todo = np.empty(2 * K + 3, np.int64)   # heap nodes to look at in a victim search
    for s in range(keys.shape[0]):
        layer = s % L
        p = 0 if parts == 1 else layer
        base = p * cap
        ph = phases[s]
        for j in range(K):
            if keys[s, j] >= 0:
                stamp[keys[s, j]] = s
        for j in range(K):
            key = keys[s, j]
            if key < 0:
                continue
            counts[ph, layer, _ACC] += 1
            i = where[key]
            if i >= 0:
                counts[ph, layer, _HIT] += 1
                hval[base + i] = nexts[s, j]   # later than before: can only rise
                _sift_up(hkey, hval, where, base, i)
                continue
            counts[ph, layer, _MISS] += 1
            if size[p] == cap:
                v = _best_unprotected(hkey, hval, stamp, s, base, size[p], todo)
                if v < 0:
                    counts[ph, layer, _BYPASS] += 1
                    continue
                _remove(hkey, hval, where, base, size, p, v)
                counts[ph, layer, _EVICT] += 1
            n = size[p]
            hkey[base + n] = key
            hval[base + n] = nexts[s, j]
            where[key] = n
            size[p] = n + 1
            _sift_up(hkey, hval, where, base, n)
            counts[ph, layer, _LOAD] += 1
    return counts


@njit(cache=True)
def _above(hkey, hval, a, b):
    # True if entry a is evicted before entry b.
    return hval[a] > hval[b] or (hval[a] == hval[b] and hkey[a] < hkey[b])


@njit(cache=True)
def _sift_up(hkey, hval, where, base, i):
    while i > 0:
        parent = (i - 1) >> 1
        if not _above(hkey, hval, base + i, base + parent):
            break
        _swap(hkey, hval, where, base, i, parent)
        i = parent


@njit(cache=True)
def _sift_down(hkey, hval, where, base, n, i):
    while True:
        best, a, b = i, 2 * i + 1, 2 * i + 2
        if a < n and _above(hkey, hval, base + a, base + best):
            best = a
        if b < n and _above(hkey, hval, base + b, base + best):
            best = b
        if best == i:
            return
        _swap(hkey, hval, where, base, i, best)
        i = best


@njit(cache=True)
def _swap(hkey, hval, where, base, i, j):
    a, b = base + i, base + j
    hkey[a], hkey[b] = hkey[b], hkey[a]
    hval[a], hval[b] = hval[b], hval[a]
    where[hkey[a]] = i
    where[hkey[b]] = j


@njit(cache=True)
def _best_unprotected(hkey, hval, stamp, s, base, n, todo):
    """Heap index of the first unprotected entry in eviction order, or -1.

    Every entry above it is protected, so it is the best unprotected child
    reachable from the root through protected entries (at most K of them).
    """
    best, top = -1, 0
    todo[top] = 0
    top = 1
    while top > 0:
        top -= 1
        i = todo[top]
        if i >= n:
            continue
        if stamp[hkey[base + i]] != s:
            if best < 0 or _above(hkey, hval, base + i, base + best):
                best = i
            continue
        todo[top] = 2 * i + 1
        todo[top + 1] = 2 * i + 2
        top += 2
    return best


@njit(cache=True)
def _remove(hkey, hval, where, base, size, p, i):
    n = size[p] - 1
    where[hkey[base + i]] = -1
    if i != n:
        hkey[base + i] = hkey[base + n]
        hval[base + i] = hval[base + n]
        where[hkey[base + i]] = i
        size[p] = n
        _sift_down(hkey, hval, where, base, n, i)
        _sift_up(hkey, hval, where, base, i)
    else:
        size[p] = n
