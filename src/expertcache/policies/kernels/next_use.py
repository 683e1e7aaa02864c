"""Kernel of ``next-use`` and its alias ``default`` (policies/next_use.py).

Per partition one policy state: its own pass length, latest step, gap histogram and
score table; per key (kept after eviction) the step of its last use, its decayed
count and its class; per partition and class a list of resident keys, oldest first
(list ``p * NCLASS + class``).

This module is the policy's only definition (the class holds its parameters):
``_use`` learns from each use, ``_believe`` guards the pass length, ``_rebuild`` and
``_scores`` turn the gap histogram into reuse odds, ``_victim`` picks the key with
the lowest odds. Histogram counts are whole or halved numbers, so their sums are
exact in any order.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..next_use import _EDGES, _GAPS, _MIN_OBS, _NCLASS, _TRUST
from .lists import append, new_lists, remove
from . import skeleton
from .skeleton import hook

EDGES = np.array(_EDGES, np.float64)
# Distinct gaps shorter than the pass length tracked per partition until one is believed.
# Real step orders see a handful (a global pool's gaps are whole passes, bar the prompt).
SHORT = 256


def state(policy, nkeys: int, parts: int, cap: int, width: int) -> tuple:
    """A fresh state of ``policy`` (a NextUse: its parameters), one per partition."""
    NC = _NCLASS
    return (*new_lists(nkeys, parts * NC),
            np.full(nkeys, -1, np.int64),            # last use, -1: never used
            np.zeros(nkeys, np.float64),             # decayed count
            np.zeros(nkeys, np.int32),               # class
            np.zeros(parts, np.int64),               # period (steps per pass), 0 until a reuse
            np.zeros(parts, np.int64),               # latest step seen
            np.zeros(parts, np.int64),               # reuses seen
            np.zeros((parts, NC, _GAPS + 2), np.float64),  # gap histogram
            np.zeros((parts, NC, _GAPS + 1), np.float64),  # score table
            np.zeros((parts, SHORT), np.int64),      # gaps shorter than the pass (0: none)
            np.zeros((parts, SHORT), np.int64),      # their sightings
            float(policy.window), np.int64(policy.horizon), np.int64(policy.rebuild_every),
            np.int64(policy.halve_every), EDGES,
            np.zeros((3, _GAPS + 2), np.float64))    # _rebuild's scratch


@hook
def on_hit(key, p, s, j, st):
    """on_access = on_insert: learn from the use, then the key goes young in its class."""
    (prev, nxt, head, tail, size, where, last, count, cls_of, period, now_p, seen, hist, score,
     gaps, sightings, window, horizon, rebuild_every, halve_every, edges, work) = st
    c = _use(key, s, p, last, count, cls_of, period, now_p, seen, hist, score, gaps, sightings,
             window, horizon, rebuild_every, halve_every, edges, work)
    if where[key] >= 0:
        remove(key, where[key], prev, nxt, head, tail, size, where)
    append(key, p * _NCLASS + c, prev, nxt, head, tail, size, where)


on_insert = on_hit


@hook
def find_victim(p, s, stamp, st):
    (prev, nxt, head, tail, size, where, last, count, cls_of, period, now_p, seen, hist, score,
     gaps, sightings, window, horizon, rebuild_every, halve_every, edges, work) = st
    return _victim(p, _NCLASS, head, nxt, stamp, s, last, score, period[p], now_p[p])


@hook
def _victim(p, NC, head, nxt, stamp, s, last, score, period, now):
    """The victim: each class's oldest unprotected key is its only candidate (within a
    class an older key scores no higher); the lowest reuse odds win, then the oldest."""
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


@hook
def on_evict(key, p, st):
    (prev, nxt, head, tail, size, where, last, count, cls_of, period, now_p, seen, hist, score,
     gaps, sightings, window, horizon, rebuild_every, halve_every, edges, work) = st
    remove(key, where[key], prev, nxt, head, tail, size, where)


@hook
def _use(key, now, p, last, count, cls_of, period, now_p, seen, hist, score, gaps, sightings,
         window, horizon, rebuild_every, halve_every, edges, work):
    """Record a use of ``key`` at step ``now``; returns its new class (the hot path)."""
    now_p[p] = now
    if last[key] < 0:
        n = 1.0
    elif now > last[key]:
        steps = now - last[key]
        if period[p] == 0 or (steps < period[p] and _believe(p, steps, gaps, sightings)):
            period[p] = steps
        passes = steps / period[p]
        gap = int(passes + 0.5)
        hist[p, cls_of[key], gap if gap <= _GAPS else _GAPS + 1] += 1.0
        n = 1.0 + count[key] * math.exp(-passes / window)
        seen[p] += 1
        if seen[p] % rebuild_every == 0:
            _rebuild(p, hist, score, seen[p], horizon, halve_every, work)
    else:
        n = count[key]                  # same step again: no new evidence
    c = 0
    while c < edges.shape[0] and edges[c] <= n:   # bisect_right
        c += 1
    last[key], count[key], cls_of[key] = now, n, c
    return c


@njit(cache=True, _nrt=False)  # a call, not inlined: rare
def _believe(p, steps, gaps, sightings):
    """A gap shorter than the pass length becomes the pass length on its _TRUST-th
    sighting. Sightings sit in a small open-addressing table per partition (arrays, not a
    typed dict, whose conversion made every live step 7x slower), emptied once a gap is
    believed; should SHORT distinct gaps pile up first, it empties and starts over."""
    n = gaps.shape[1]
    i = steps % n
    for _ in range(n):
        if gaps[p, i] == steps or gaps[p, i] == 0:
            break
        i = (i + 1) % n
    else:  # full: start over
        gaps[p, :] = 0
        i = steps % n
    if gaps[p, i] == 0:
        gaps[p, i], sightings[p, i] = steps, 0
    sightings[p, i] += 1
    if sightings[p, i] < _TRUST:
        return False
    gaps[p, :] = 0
    return True


@njit(cache=True, _nrt=False)  # a call, not inlined: rare, and it would bloat each copy
def _rebuild(p, hist, score, seen, horizon, halve_every, work):
    """The score table from the gap histogram (halved now and then, to follow drift); a
    class with fewer than _MIN_OBS reuses on record borrows the pooled score. ``work``
    [3, _GAPS + 2] holds the pooled counts, their scores and ``_scores``' sums: the loop
    allocates nothing, so it runs without reference counting."""
    NC, G = hist.shape[1], hist.shape[2]
    if seen % halve_every == 0:
        for c in range(NC):
            for g in range(G):
                hist[p, c, g] = hist[p, c, g] / 2
    pooled, pooled_score, later = work[0], work[1], work[2]
    for g in range(G):
        pooled[g] = 0.0
        for c in range(NC):
            pooled[g] += hist[p, c, g]
    _scores(pooled, horizon, later, pooled_score)
    for c in range(NC):
        total = 0.0
        for g in range(G):
            total += hist[p, c, g]
        if total >= _MIN_OBS:
            _scores(hist[p, c], horizon, later, score[p, c])
        else:
            for a in range(_GAPS + 1):
                score[p, c, a] = pooled_score[a]


@hook
def _scores(row, h, later, out):
    """out[a] = P(reuse within h passes | no reuse for a passes), from gap counts ``row``;
    gaps past _GAPS sit in one bucket known only to be longer. ``later``: scratch."""
    top = _GAPS + 1
    later[top] = 0.0
    for g in range(top, 0, -1):
        later[g - 1] = later[g] + row[g]
    for a in range(top):
        out[a] = (later[a] - later[min(a + h, _GAPS)]) / later[a] if later[a] else 0.0


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
