"""LRU at every size from one pass of stack distances (plain LRU, admission always).

Under step protection the victim is always the least recent key *outside* the step, and
every key of a step ends at the recent end in rank order. By induction a full cache then
holds exactly the ``C`` most recently used keys (recency = position in the flattened
access sequence), so a key is a hit iff fewer than ``C`` distinct keys were used between
its last use and the *start* of its step. The pass measures that distance for every
access (Fenwick tree over positions, queries before the step's updates), and a histogram
answers every capacity at once. Tested equal to the lru kernel (tests/test_sim_fast.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..policies.kernels.skeleton import ACC, EVICT, HIT, LOAD, MISS


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
    counts[..., ACC] = accesses
    counts[..., HIT] = hits
    counts[..., MISS] = accesses - hits
    counts[..., LOAD] = accesses - hits
    counts[..., EVICT] = accesses - hits - fill
    return counts


def _bincount(phase, layer, mask, L):
    idx = phase[mask].astype(np.int64) * L + layer[mask]
    return np.bincount(idx, minlength=2 * L).reshape(2, L)


