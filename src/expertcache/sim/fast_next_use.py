"""Exact numba kernel for ``next-use`` (and its alias ``default``; policies/next_use.py).

It mirrors the policy call for call under the SlotTable step loop (forced admission,
no pins, no seed): per partition one policy state, i.e. its own pass length, latest
step, gap histogram and score table; per key (kept after eviction) the step of its
last use, its decayed count and its class; per partition and class a linked list of
resident keys, oldest first (``fast_lists`` helpers, list ``p * NCLASS + class``).

Floats follow the Python code operation for operation (``steps / period``,
``math.exp``, sums of histogram counts, which are whole or halved numbers and so
exact in any order), so the victims are the same; tests/test_sim_fast.py holds the
counts equal to SlotTable on random and real traces.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba import types
from numba.typed import Dict

from ..policies.next_use import _EDGES, _GAPS, _MIN_OBS, _NCLASS, _TRUST
from .fast import _tally
from .fast_lists import _append, _remove

EDGES = np.array(_EDGES, np.float64)


def next_use_replay(keys, phases, L, E, parts, cap, policy):
    """Counts ``int64 [2, L, 6]``; ``policy`` is a fresh NextUse (its parameters are read)."""
    return _replay(keys, phases, L, E, parts, cap, float(policy.window), int(policy.horizon),
                   int(policy.rebuild_every), int(policy.halve_every), EDGES)


@njit(cache=True)
def _replay(keys, phases, L, E, parts, cap, window, horizon, rebuild_every, halve_every, edges):
    NC = _NCLASS
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    # per key: linked-list links, list id (-1: not resident), last use, decayed count, class
    prev = np.full(nkeys, -1, np.int32)
    nxt = np.full(nkeys, -1, np.int32)
    where = np.full(nkeys, -1, np.int32)
    last = np.full(nkeys, -1, np.int64)        # -1: never used (no info)
    count = np.zeros(nkeys, np.float64)
    cls_of = np.zeros(nkeys, np.int32)
    stamp = np.full(nkeys, -1, np.int64)       # step that last needed the key = protected
    # per partition: lists, occupancy, policy state
    head = np.full(parts * NC, -1, np.int32)
    tail = np.full(parts * NC, -1, np.int32)
    size = np.zeros(parts * NC, np.int64)
    used = np.zeros(parts, np.int64)
    period = np.zeros(parts, np.int64)
    now_p = np.zeros(parts, np.int64)
    seen = np.zeros(parts, np.int64)
    hist = np.zeros((parts, NC, _GAPS + 2), np.float64)
    score = np.zeros((parts, NC, _GAPS + 1), np.float64)
    # gaps shorter than the pass length -> sightings; key p << 40 | gap, value gen << 8 | n
    # (a generation bump per partition stands for the policy's dict.clear())
    shorter = Dict.empty(types.int64, types.int64)
    gen = np.zeros(parts, np.int64)
    K = keys.shape[1]
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1   # s % L
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
            if where[key] >= 0:          # hit: on_access
                hit += 1
            else:
                if used[p] == cap:
                    victim = _victim(p, NC, head, nxt, stamp, s, last, score, period[p], now_p[p])
                    if victim < 0:
                        bypass += 1
                        continue
                    _remove(victim, where[victim], prev, nxt, head, tail, size, where)
                    used[p] -= 1
                    evict += 1
                used[p] += 1
            # on_insert / on_access: learn from the use, then the key goes young in its class
            c = _use(key, s, p, last, count, cls_of, period, now_p, seen, hist, score,
                     shorter, gen, window, horizon, rebuild_every, halve_every, edges)
            if where[key] >= 0:
                _remove(key, where[key], prev, nxt, head, tail, size, where)
            _append(key, p * NC + c, prev, nxt, head, tail, size, where)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=True)
def _victim(p, NC, head, nxt, stamp, s, last, score, period, now):
    """NextUse.victim: each class's oldest unprotected key; lowest odds, then oldest."""
    per = period if period > 0 else 1
    best, best_score, best_last = -1, 2.0, 0
    for c in range(NC):
        key = head[p * NC + c]
        while key >= 0 and stamp[key] == s:
            key = nxt[key]
        if key < 0:
            continue
        age = (now - last[key]) // per
        odds = score[p, c, age] if age < _GAPS else score[p, c, _GAPS]
        if odds < best_score or (odds == best_score and last[key] < best_last):
            best, best_score, best_last = key, odds, last[key]
    return best


@njit(cache=True)
def _use(key, now, p, last, count, cls_of, period, now_p, seen, hist, score, shorter, gen,
         window, horizon, rebuild_every, halve_every, edges):
    """NextUse._use: record a use of ``key`` at step ``now``; returns its new class."""
    now_p[p] = now
    if last[key] < 0:
        n = 1.0
    elif now > last[key]:
        steps = now - last[key]
        if period[p] == 0 or (steps < period[p] and _believe(p, steps, shorter, gen)):
            period[p] = steps
        passes = steps / period[p]
        gap = int(passes + 0.5)
        hist[p, cls_of[key], gap if gap <= _GAPS else _GAPS + 1] += 1.0
        n = 1.0 + count[key] * math.exp(-passes / window)
        seen[p] += 1
        if seen[p] % rebuild_every == 0:
            _rebuild(p, hist, score, seen[p], horizon, halve_every)
    else:
        n = count[key]                  # same step again: no new evidence
    c = 0
    while c < edges.shape[0] and edges[c] <= n:   # bisect_right
        c += 1
    last[key], count[key], cls_of[key] = now, n, c
    return c


@njit(cache=True)
def _believe(p, steps, shorter, gen):
    """NextUse._believe, the dict keyed per partition and cleared by a generation bump."""
    k = (np.int64(p) << 40) | steps
    n = 0
    if k in shorter:
        v = shorter[k]
        if v >> 8 == gen[p]:
            n = v & 0xFF
    n += 1
    if n < _TRUST:
        shorter[k] = (gen[p] << 8) | n
        return False
    gen[p] += 1
    return True


@njit(cache=True)
def _rebuild(p, hist, score, seen, horizon, halve_every):
    NC = hist.shape[1]
    if seen % halve_every == 0:
        for c in range(NC):
            for g in range(hist.shape[2]):
                hist[p, c, g] = hist[p, c, g] / 2
    pooled = np.zeros(hist.shape[2], np.float64)
    for g in range(hist.shape[2]):
        for c in range(NC):
            pooled[g] += hist[p, c, g]
    pooled_score = _scores(pooled, horizon)
    for c in range(NC):
        total = 0.0
        for g in range(hist.shape[2]):
            total += hist[p, c, g]
        score[p, c, :] = _scores(hist[p, c], horizon) if total >= _MIN_OBS else pooled_score


@njit(cache=True)
def _scores(row, h):
    """score[a] = P(reuse within h passes | no reuse for a passes), as NextUse._scores."""
    top = _GAPS + 1
    later = np.zeros(top + 1, np.float64)
    for g in range(top, 0, -1):
        later[g - 1] = later[g] + row[g]
    out = np.zeros(top, np.float64)
    for a in range(top):
        if later[a]:
            out[a] = (later[a] - later[min(a + h, _GAPS)]) / later[a]
    return out
