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
KEY_BITS = 21    # belady's heap packs (next use, key) into one int64: keys < 2**21
_KEY_MASK = (1 << KEY_BITS) - 1
_STEP_MAX = (1 << (62 - KEY_BITS)) - 1  # stands for NEVER; real steps stay far below
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


# -- LRU / FIFO at one capacity ------------------------------------------------
# Admission codes for list_replay (policies/admission.py): always, second-hit, window.
ADMIT_ALWAYS, ADMIT_SECOND_HIT, ADMIT_WINDOW = 0, 1, 2


@njit(cache=True)
def list_replay(keys, phases, L, E, parts, cap, lru, admit=0, ghost=1, n_uses=1, window=1):
    """LRU (``lru=True``) or FIFO at one capacity per partition, with admission.

    ``parts`` is 1 (global pool) or L (one partition per layer). A doubly
    linked list per partition keeps insertion / recency order, oldest first.
    ``admit`` picks the admission policy: second-hit keeps a ghost LRU list of
    ``ghost`` keys per partition (touched by every access); window admits a
    key used ``n_uses`` times within its layer's last ``window`` steps. Either
    only decides when the miss would evict. List surgery is inline, counts
    are summed per step, and no helper takes arrays (each call would pay
    reference counting): this loop runs millions of times, and that made it
    about ten times faster.
    """
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    prev = np.full(nkeys, -1, np.int32)
    nxt = np.full(nkeys, -1, np.int32)
    head = np.full(parts, -1, np.int32)
    tail = np.full(parts, -1, np.int32)
    used = np.zeros(parts, np.int64)
    resident = np.zeros(nkeys, np.bool_)
    stamp = np.full(nkeys, -1, np.int32)  # step that last needed the key = protected
    # second-hit: a ghost LRU list per partition (same layout as the cache's)
    gprev = np.full(nkeys, -1, np.int32)
    gnext = np.full(nkeys, -1, np.int32)
    ghead = np.full(parts, -1, np.int32)
    gtail = np.full(parts, -1, np.int32)
    gsize = np.zeros(parts, np.int64)
    in_ghost = np.zeros(nkeys, np.bool_)
    # window: the last n_uses use times (token index = the layer's step count) per key
    uses = np.full((nkeys if admit == ADMIT_WINDOW else 1, n_uses), -(1 << 40), np.int64)
    nuse = np.zeros(nkeys if admit == ADMIT_WINDOW else 1, np.int64)
    K = keys.shape[1]
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1   # s % L
        token = s // L                               # the layer's own step count
        p = 0 if parts == 1 else layer
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
            ok = True  # admission's answer should this access miss with the pool full
            if admit == ADMIT_SECOND_HIT:
                ok = in_ghost[key]
                if ok:  # unlink from the ghost list (re-appended below)
                    a, b = gprev[key], gnext[key]
                    if a >= 0:
                        gnext[a] = b
                    else:
                        ghead[p] = b
                    if b >= 0:
                        gprev[b] = a
                    else:
                        gtail[p] = a
                else:
                    in_ghost[key] = True
                    gsize[p] += 1
                t = gtail[p]
                gprev[key], gnext[key] = t, -1
                if t >= 0:
                    gnext[t] = key
                else:
                    ghead[p] = key
                gtail[p] = key
                if gsize[p] > ghost:  # forget the oldest ghost
                    old = ghead[p]
                    ghead[p] = gnext[old]
                    gprev[gnext[old]] = -1  # ghost > 0, so old is not the only entry
                    in_ghost[old] = False
                    gsize[p] -= 1
            elif admit == ADMIT_WINDOW:
                u, c = uses[key], nuse[key]
                u[c % n_uses] = token     # ring of the key's last n_uses use times
                nuse[key] = c + 1
                # n_uses uses within the window iff the oldest in the ring is in it
                ok = u[(c + 1) % n_uses] > token - window
            if resident[key]:
                hit += 1
                if lru and tail[p] != key:  # move to the recent end (key has a successor)
                    a, b = prev[key], nxt[key]
                    if a >= 0:
                        nxt[a] = b
                    else:
                        head[p] = b
                    prev[b] = a
                    t = tail[p]
                    prev[key], nxt[key], nxt[t], tail[p] = t, -1, key, key
                continue
            if used[p] < cap:
                used[p] += 1
            else:
                victim = head[p]
                while victim >= 0 and stamp[victim] == s:
                    victim = nxt[victim]
                if victim < 0 or not ok:  # all protected, or admission said no
                    bypass += 1
                    continue
                a, b = prev[victim], nxt[victim]
                if a >= 0:
                    nxt[a] = b
                else:
                    head[p] = b
                if b >= 0:
                    prev[b] = a
                else:
                    tail[p] = a
                resident[victim] = False
                evict += 1
            t = tail[p]
            prev[key], nxt[key] = t, -1
            if t >= 0:
                nxt[t] = key
            else:
                head[p] = key
            tail[p] = key
            resident[key] = True
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=True)
def _tally(c, acc, hit, bypass, evict):
    # One step's counts into its (phase, layer) row, in stats.FIELDS order.
    c[_ACC] += acc
    c[_HIT] += hit
    c[_MISS] += acc - hit
    c[_LOAD] += acc - hit - bypass
    c[_EVICT] += evict
    c[_BYPASS] += bypass


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
    tree = np.zeros(parts * (per_part + 1), np.int32)  # one Fenwick tree per partition
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

    A max-heap per partition holds one int64 per resident key, ``_prio(next
    use, key)``: it orders by next use (later first), then by smaller key,
    the order policies.belady's heap pops in, so ties break the same way.
    ``where[key]`` is the key's heap index, so a hit updates it in place.
    """
    counts = np.zeros((2, L, 6), np.int64)
    heap = np.empty(parts * cap, np.int64)
    size = np.zeros(parts, np.int64)
    where = np.full(L * E, -1, np.int32)   # heap index of a resident key, -1 = absent
    stamp = np.full(L * E, -1, np.int32)   # step that last needed the key = protected
    K = keys.shape[1]
    todo = np.empty(2 * K + 3, np.int64)   # heap nodes to look at in a victim search
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1   # s % L
        p = 0 if parts == 1 else layer
        base = p * cap
        row, nrow = keys[s], nexts[s]
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
            if i >= 0:
                hit += 1
                heap[base + i] = _prio(nrow[j], key)   # later than before: can only rise
                _sift_up(heap, where, base, i)
                continue
            n = size[p]
            if n == cap:
                v = _best_unprotected(heap, stamp, s, base, n, todo)
                if v < 0:
                    bypass += 1
                    continue
                where[_key(heap[base + v])] = -1
                n -= 1
                if v != n:  # move the last entry into the hole, then restore order
                    heap[base + v] = heap[base + n]
                    _sift_down(heap, where, base, n, v)
                    _sift_up(heap, where, base, v)
                evict += 1
            heap[base + n] = _prio(nrow[j], key)
            size[p] = n + 1
            _sift_up(heap, where, base, n)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=True)
def _prio(next_use, key):
    # Larger = evicted first. NEVER maps to the largest step the field holds.
    return (min(next_use, _STEP_MAX) << KEY_BITS) | (_KEY_MASK - key)


@njit(cache=True)
def _key(prio):
    return _KEY_MASK - (prio & _KEY_MASK)


@njit(cache=True)
def _sift_up(heap, where, base, i):
    x = heap[base + i]
    while i > 0:
        parent = (i - 1) >> 1
        y = heap[base + parent]
        if y >= x:
            break
        heap[base + i] = y
        where[_key(y)] = i
        i = parent
    heap[base + i] = x
    where[_key(x)] = i


@njit(cache=True)
def _sift_down(heap, where, base, n, i):
    x = heap[base + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and heap[base + c + 1] > heap[base + c]:
            c += 1
        y = heap[base + c]
        if y <= x:
            break
        heap[base + i] = y
        where[_key(y)] = i
        i = c
    heap[base + i] = x
    where[_key(x)] = i


@njit(cache=True)
def _best_unprotected(heap, stamp, s, base, n, todo):
    """Heap index of the first unprotected entry in eviction order, or -1.

    Every entry above it is protected, so it is the best unprotected child
    reachable from the root through protected entries (at most K of them).
    """
    best, top = -1, 1
    todo[0] = 0
    while top > 0:
        top -= 1
        i = todo[top]
        if i >= n:
            continue
        if stamp[_key(heap[base + i])] != s:
            if best < 0 or heap[base + i] > heap[base + best]:
                best = i
            continue
        todo[top] = 2 * i + 1
        todo[top + 1] = 2 * i + 2
        top += 2
    return best
