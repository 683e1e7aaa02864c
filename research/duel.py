"""next-use vs LRU, arbitrated online by regret (LeCaR-style), for robustness on unseen models.

next-use loses to LRU on some synthetic presets (few experts, a pool of about one token's
accesses: mixtral global 25%, gpt-oss-20b / olmoe global 12.5%; docs/policies.md, "Where
it loses"). The default is judged on models not in ../shared/traces too, so a default that
follows whichever rule is winning could be worth more than a tuned one. LeCaR (Vietri et
al., HotStorage 2018) keeps a weight per rule: each eviction is made by the heavier rule
and remembered (ghost) with who made it; a later miss on a ghost whose eviction only that
rule wanted shifts weight to the other, discounted by how long ago it was evicted.

Research copy of sim/kernels/next_use.py's loop (same _use, same _victim); not shipped.

    .venv/bin/python research/duel.py code general synth:mixtral-8x7b:2000 synth:olmoe:2000
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from numba import njit
from numba import types
from numba.typed import Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from policy_research import CONFIGS, load, slots_of  # noqa: E402

from expertcache.policies.next_use import _GAPS, _NCLASS, NextUse  # noqa: E402
from expertcache.sim.kernels.skeleton import tally as _tally  # noqa: E402
from expertcache.sim.kernels.lists import append as _append, remove as _remove  # noqa: E402
from expertcache.sim.kernels.next_use import EDGES, _use, _victim  # noqa: E402
from expertcache.sim.replay import Prepared, replay  # noqa: E402


@njit(cache=False)
def _oldest(p, NC, head, nxt, stamp, s, last):
    """LRU's victim: the oldest unprotected key over all class lists (each is oldest-first)."""
    best, best_last = -1, 0
    for c in range(NC):
        key = head[p * NC + c]
        while key >= 0 and stamp[key] == s:
            key = nxt[key]
        if key >= 0 and (best < 0 or last[key] < best_last):
            best, best_last = key, last[key]
    return best


@njit(cache=False)
def _duel(keys, phases, L, E, parts, cap, window, horizon, rebuild_every, halve_every, edges,
          lam, mode):
    """mode 0: next-use only (must equal the shipped kernel); 1: LeCaR duel with LRU."""
    NC = _NCLASS
    nkeys = L * E
    counts = np.zeros((2, L, 6), np.int64)
    prev = np.full(nkeys, -1, np.int32)
    nxt = np.full(nkeys, -1, np.int32)
    where = np.full(nkeys, -1, np.int32)
    last = np.full(nkeys, -1, np.int64)
    count = np.zeros(nkeys, np.float64)
    cls_of = np.zeros(nkeys, np.int32)
    stamp = np.full(nkeys, -1, np.int64)
    head = np.full(parts * NC, -1, np.int32)
    tail = np.full(parts * NC, -1, np.int32)
    size = np.zeros(parts * NC, np.int64)
    used = np.zeros(parts, np.int64)
    period = np.zeros(parts, np.int64)
    now_p = np.zeros(parts, np.int64)
    seen = np.zeros(parts, np.int64)
    hist = np.zeros((parts, NC, _GAPS + 2), np.float64)
    score = np.zeros((parts, NC, _GAPS + 1), np.float64)
    shorter = Dict.empty(types.int64, types.int64)
    gen = np.zeros(parts, np.int64)
    # duel state: weight of next-use per partition, ghosts: who evicted the key, when
    w_nu = np.full(parts, 0.5)
    evictions = np.zeros(parts, np.int64)
    ghost_by = np.full(nkeys, -1, np.int8)      # 0 next-use alone, 1 lru alone, 2 both
    ghost_t = np.zeros(nkeys, np.int64)
    discount = 0.005 ** (1.0 / cap)
    K = keys.shape[1]
    layer = L - 1
    for s in range(keys.shape[0]):
        layer = 0 if layer == L - 1 else layer + 1
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
            if where[key] >= 0:
                hit += 1
            else:
                if mode == 1 and ghost_by[key] >= 0:
                    age = evictions[p] - ghost_t[key]
                    if age <= cap and ghost_by[key] < 2:
                        r = math.exp(-lam * discount ** age)   # the rule that evicted it pays
                        wn, wl = w_nu[p], 1.0 - w_nu[p]
                        if ghost_by[key] == 0:
                            wn *= r
                        else:
                            wl *= r
                        w_nu[p] = min(0.99, max(0.01, wn / (wn + wl)))
                    ghost_by[key] = -1
                if used[p] == cap:
                    victim = _victim(p, NC, head, nxt, stamp, s, last, score, period[p], now_p[p])
                    if victim < 0:
                        bypass += 1
                        continue
                    if mode == 1:
                        old = _oldest(p, NC, head, nxt, stamp, s, last)
                        if old == victim:
                            ghost_by[victim] = 2
                        elif w_nu[p] >= 0.5:
                            ghost_by[victim] = 0
                        else:
                            victim = old
                            ghost_by[victim] = 1
                        ghost_t[victim] = evictions[p]
                        evictions[p] += 1
                    _remove(victim, where[victim], prev, nxt, head, tail, size, where)
                    used[p] -= 1
                    evict += 1
                used[p] += 1
            c = _use(key, s, p, last, count, cls_of, period, now_p, seen, hist, score,
                     shorter, gen, window, horizon, rebuild_every, halve_every, edges)
            if where[key] >= 0:
                _remove(key, where[key], prev, nxt, head, tail, size, where)
            _append(key, p * NC + c, prev, nxt, head, tail, size, where)
        _tally(counts[phases[s], layer], acc, hit, bypass, evict)
    return counts


def misses(prep: Prepared, slots: int, part: str, mode: int, lam: float) -> int:
    pol = NextUse(slots)
    parts = prep.L if part == "per-layer" else 1
    cap = slots // parts
    c = _duel(prep.keys, prep.phases, prep.L, prep.E, parts, cap, float(pol.window),
              int(pol.horizon), int(pol.rebuild_every), int(pol.halve_every), EDGES, lam, mode)
    return int(c[:, :, 0].sum() - c[:, :, 1].sum())


def main(names) -> None:
    lam = 0.45
    for name in names:
        prep = Prepared(load(name, 0))
        rows = {"lru": [], "next-use": [], "duel": []}
        for part, frac in CONFIGS:
            slots = slots_of(prep.trace, frac)
            if part == "per-layer" and slots // prep.L <= prep.trace.top_k:
                continue
            best = replay(prep, "belady", slots, part).misses
            shipped = replay(prep, "next-use", slots, part).misses
            mine = misses(prep, slots, part, 0, lam)
            assert mine == shipped, (name, part, frac, mine, shipped)  # the copy is faithful
            rows["lru"].append(replay(prep, "lru", slots, part).misses / best)
            rows["next-use"].append(shipped / best)
            rows["duel"].append(misses(prep, slots, part, 1, lam) / best)
        print(name, " | ".join(f"{k} " + " ".join(f"{v:.3f}" for v in vs) + f" avg {np.mean(vs):.3f}"
                               for k, vs in rows.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["code", "general"])
