"""Round two: reuse odds rounded to 1/q before ranking, so near-equal odds (flat popularity,\nnoisy estimates) fall to the LRU tie-break. q=0: shipped. Research copy of sim/kernels/next_use.py.\n\n    .venv/bin/python research/quantised_odds.py synth:mixtral-8x7b code general\n"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba import types
from numba.typed import Dict

from expertcache.policies.next_use import _EDGES, _GAPS, _MIN_OBS, _NCLASS, _TRUST
from expertcache.sim.kernels.skeleton import tally as _tally
from expertcache.sim.kernels.lists import append as _append, remove as _remove

EDGES = np.array(_EDGES, np.float64)


def next_use_replay(keys, phases, L, E, parts, cap, policy, q=0.0):
    """Counts ``int64 [2, L, 6]``; ``policy`` is a fresh NextUse (its parameters are read)."""
    return _replay(keys, phases, L, E, parts, cap, float(policy.window), int(policy.horizon),
                   int(policy.rebuild_every), int(policy.halve_every), EDGES, q)


@njit(cache=False)
def _replay(keys, phases, L, E, parts, cap, window, horizon, rebuild_every, halve_every, edges, q):
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
                     shorter, gen, window, horizon, rebuild_every, halve_every, edges, q)
            if where[key] >= 0:
                _remove(key, where[key], prev, nxt, head, tail, size, where)
            _append(key, p * NC + c, prev, nxt, head, tail, size, where)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


@njit(cache=False)
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


@njit(cache=False)
def _use(key, now, p, last, count, cls_of, period, now_p, seen, hist, score, shorter, gen,
         window, horizon, rebuild_every, halve_every, edges, q):
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
            _rebuild(p, hist, score, seen[p], horizon, halve_every, q)
    else:
        n = count[key]                  # same step again: no new evidence
    c = 0
    while c < edges.shape[0] and edges[c] <= n:   # bisect_right
        c += 1
    last[key], count[key], cls_of[key] = now, n, c
    return c


@njit(cache=False)
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


@njit(cache=False)
def _rebuild(p, hist, score, seen, horizon, halve_every, q):
    NC = hist.shape[1]
    if seen % halve_every == 0:
        for c in range(NC):
            for g in range(hist.shape[2]):
                hist[p, c, g] = hist[p, c, g] / 2
    pooled = np.zeros(hist.shape[2], np.float64)
    for g in range(hist.shape[2]):
        for c in range(NC):
            pooled[g] += hist[p, c, g]
    pooled_score = _scores(pooled, horizon, q)
    for c in range(NC):
        total = 0.0
        for g in range(hist.shape[2]):
            total += hist[p, c, g]
        score[p, c, :] = _scores(hist[p, c], horizon, q) if total >= _MIN_OBS else pooled_score


@njit(cache=False)
def _scores(row, h, q):
    """score[a] = P(reuse within h passes | no reuse for a passes), as NextUse._scores."""
    top = _GAPS + 1
    later = np.zeros(top + 1, np.float64)
    for g in range(top, 0, -1):
        later[g - 1] = later[g] + row[g]
    out = np.zeros(top, np.float64)
    for a in range(top):
        if later[a]:
            out[a] = (later[a] - later[min(a + h, _GAPS)]) / later[a]
            if q > 0:
                out[a] = np.floor(out[a] * q + 0.5) / q
    return out


FIRST = {"window": 64.0, "horizon": 4}   # the setting these figures were measured with (round one)


if __name__ == "__main__":
    import sys
    from expertcache.policies.registry import make_eviction
    from expertcache.sim.replay import Prepared, replay
    from expertcache.trace import load_trace
    from expertcache.trace.synth import synth_trace
    QS = (0.0, 100.0, 50.0, 20.0, 10.0)
    for name in sys.argv[1:]:
        if name.startswith("synth:"):
            trace = synth_trace(name.split(":")[1], 2000, seed=0)
        else:
            trace = load_trace(f"../shared/traces/qwen3-30b-a3b-{name}.npz")
        prep = Prepared(trace)
        n = prep.L * prep.E
        rows = {}
        for part in ("global", "per-layer"):
            for frac in (0.125, 0.25):
                slots = round(frac * n)
                cap = slots if part == "global" else slots // prep.L
                if cap <= trace.top_k:
                    continue
                b = replay(prep, "belady", slots, part).misses
                lru = replay(prep, "lru", slots, part).misses
                parts = 1 if part == "global" else prep.L
                r = [int(next_use_replay(prep.keys, prep.phases, prep.L, prep.E, parts, cap,
                                         make_eviction("next-use", cap), q)[:, :, 2].sum()) / b for q in QS]
                rows[(part, frac)] = r
                print(name, part, frac, f"lru {lru / b:.3f}", " ".join(f"q{q:g} {x:.3f}" for q, x in zip(QS, r)), flush=True)
        avg = [sum(r[i] for r in rows.values()) / len(rows) for i in range(len(QS))]
        print(name, "avg", " ".join(f"q{q:g} {x:.3f}" for q, x in zip(QS, avg)), flush=True)
