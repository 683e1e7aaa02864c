"""Round two: the next-use kernel's loop with victim variants (mode 0: the shipped victim;
mode 1: scan, layer-phase tie-break; mode 2: odds discounted by the wait for the key's layer;
modes 3, 4: the same on each class's oldest age group only). Learning (``_use``) and the
shipped victim come from sim/kernels/next_use.py. Not shipped. Global pool, 768 and 1536 slots.

    .venv/bin/python research/kernel_variants.py code general
"""


from __future__ import annotations

import numpy as np
from numba import njit
from numba import types
from numba.typed import Dict

from expertcache.policies.next_use import _GAPS, _NCLASS
from expertcache.sim.kernels.lists import append as _append, remove as _remove
# the shipped kernel's own learning and victim search; this file varies the victim only
from expertcache.sim.kernels.next_use import EDGES, _use, _victim
from expertcache.sim.kernels.skeleton import tally as _tally


def next_use_replay(keys, phases, L, E, parts, cap, policy, mode=0):
    """Counts ``int64 [2, L, 6]``; ``policy`` is a fresh NextUse (its parameters are read)."""
    return _replay(keys, phases, L, E, parts, cap, float(policy.window), int(policy.horizon),
                   int(policy.rebuild_every), int(policy.halve_every), EDGES, mode)


@njit(cache=False)
def _replay(keys, phases, L, E, parts, cap, window, horizon, rebuild_every, halve_every, edges, mode):
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
                    victim = _victim(p, NC, head, nxt, stamp, s, last, score, period[p], now_p[p]) if mode == 0 else (_scan(p, NC, head, nxt, stamp, s, last, score, period[p], now_p[p], mode) if mode < 3 else _group(p, NC, head, nxt, stamp, s, last, score, period[p], now_p[p], mode))
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


@njit(cache=False)
def _scan(p, NC, head, nxt, stamp, s, last, score, period, now, mode):
    """Every resident key: lowest odds; ties (mode 1) to the key whose layer comes round last;
    mode 2: odds discounted by the wait for its layer (a chance later is worth less)."""
    per = period if period > 0 else 1
    best, b0, b1, b2 = -1, 2.0, 0.0, 0
    for c in range(NC):
        key = head[p * NC + c]
        while key >= 0:
            if stamp[key] != s:
                age = (now - last[key]) // per
                odds = score[p, c, age] if age < _GAPS else score[p, c, _GAPS]
                d = (last[key] - now) % per
                if d == 0:
                    d = per
                if mode == 2:
                    odds = odds * (1.0 - 0.3 * d / per)
                r1 = -float(d)
                if odds < b0 or (odds == b0 and (r1 < b1 or (r1 == b1 and last[key] < b2))):
                    best, b0, b1, b2 = key, odds, r1, last[key]
            key = nxt[key]
    return best


@njit(cache=False)
def _group(p, NC, head, nxt, stamp, s, last, score, period, now, mode):
    """Mode 3 / 4: per class only the oldest key's age group (same odds), and in it the
    newest unprotected key (its layer comes round last); ranked as mode 1 / mode 2."""
    per = period if period > 0 else 1
    best, b0, b1, b2 = -1, 2.0, 0.0, 0
    for c in range(NC):
        key = head[p * NC + c]
        while key >= 0 and stamp[key] == s:
            key = nxt[key]
        if key < 0:
            continue
        age = (now - last[key]) // per
        bound = now - age * per          # the group: last <= bound
        pick = key
        k = nxt[key]
        while k >= 0 and last[k] <= bound:
            if stamp[k] != s:
                pick = k
            k = nxt[k]
        odds = score[p, c, age] if age < _GAPS else score[p, c, _GAPS]
        d = (last[pick] - now) % per
        if d == 0:
            d = per
        if mode == 4:
            odds = odds * (1.0 - 0.3 * d / per)
        r1 = -float(d)
        if odds < b0 or (odds == b0 and (r1 < b1 or (r1 == b1 and last[pick] < b2))):
            best, b0, b1, b2 = pick, odds, r1, last[pick]
    return best


FIRST = {"window": 64.0, "horizon": 4}   # the setting these figures were measured with (round one)


if __name__ == "__main__":
    import sys
    from expertcache.policies.registry import make_eviction
    from expertcache.sim.replay import Prepared, replay
    from expertcache.trace import load_trace
    MODES = (0, 1, 2, 3, 4)   # 3, 4: modes 1, 2 on each class's oldest age group only
    for name in sys.argv[1:]:
        prep = Prepared(load_trace(f"../shared/traces/qwen3-30b-a3b-{name}.npz"))
        for slots in (768, 1536):
            b = replay(prep, "belady", slots, "global").misses
            out = []
            for mode in MODES:
                c = next_use_replay(prep.keys, prep.phases, prep.L, prep.E, 1, slots,
                                    make_eviction("next-use", slots, **FIRST), mode)
                out.append(int(c[:, :, 2].sum()) / b)
            print(name, "global", slots, " ".join(f"mode{m} {x:.3f}" for m, x in enumerate(out)), flush=True)
