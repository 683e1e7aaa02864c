"""``sim --lag``'s fast path: ``lagged.LaggedTable``'s replay (``sim/lag.py``) over a compiled log.

The lag does not change what the table decides, only when the device learns it: the table
steps through the same steps in the same order at every lag (a forward's steps when it is
decided, a prefill's at once). So one compiled replay of the trace (the policy kernel's
``replay_log``: per step and column, the key a load evicted, a free slot, or no load) serves
every lag, and this pass replays the device from that log for one lag, as ``LaggedTable``
does step by step in Python: the device's slot map, its hits and misses per forward, the
staging rows and where each load is copied from. It is tested equal to ``LaggedTable``
(tests/test_sim_lag.py), count for count.

Slots as ``SlotTable`` hands them out: a load takes its victim's slot, else the lowest free
slot of its partition (slots are never freed without a load taking them).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..policies.kernels.skeleton import ACC, BYPASS, EVICT, HIT, LOAD, MISS, NOT_LOADED

PREFILL = 0


@njit(cache=True)
def lagged_counts(keys, row_phase, log, L, nkeys, parts, cap, lag, width, blocks):
    """Counts ``int64 [2, L, 6]`` (``stats.FIELDS``) and ``(staged, staging_loads,
    host_loads)`` of a device ``lag`` forwards behind the table. ``keys int32 [R*L, W]``
    (``Prepared.keys``), ``row_phase uint8 [R]``, ``log`` from ``replay_log``; ``width``
    staging rows per block, ``blocks`` blocks (layer l stages into block l % blocks)."""
    R = row_phase.shape[0]
    W = keys.shape[1]
    counts = np.zeros((2, L, 6), np.int64)
    tab = np.full(nkeys, -1, np.int32)      # the table's slot of each key
    dev = np.full(nkeys, -1, np.int32)      # the device's slot map (the mirror)
    used = np.zeros(parts, np.int64)        # slots handed out per partition
    staging = np.full(blocks * width, -1, np.int32)  # key each staging row holds
    held = np.zeros(nkeys, np.int32)        # staging rows holding each key
    missed = np.zeros(keys.shape, np.bool_)  # device misses of observed forwards
    mark = np.full(nkeys, -1, np.int64)     # decision round that last touched a key
    touched = np.empty(nkeys, np.int32)
    buf = np.empty(max(W, 1), np.int32)
    out = np.zeros(3, np.int64)             # staged, staging_loads, host_loads
    first = 0                               # first forward not yet decided
    rounds = 0
    for r in range(R):
        if row_phase[r] == PREFILL:
            _decide(keys, row_phase, log, L, parts, cap, first, r, counts, tab, dev, used, held,
                    missed, mark, touched, rounds, out)
            rounds += 1
            for l in range(L):  # the host plans it itself; the mirror follows at once
                s = r * L + l
                p = 0 if parts == 1 else l
                acc = hit = loads = evicts = 0
                for j in range(W):
                    key = keys[s, j]
                    if key < 0:
                        continue
                    acc += 1
                    if tab[key] >= 0:
                        hit += 1
                    v = log[s, j]
                    if v == NOT_LOADED:
                        continue
                    loads += 1
                    if v >= 0:
                        evicts += 1
                        slot = tab[v]
                        tab[v] = -1
                        dev[v] = -1
                    else:
                        slot = p * cap + used[p]
                        used[p] += 1
                    tab[key] = slot
                    dev[key] = slot
                c = counts[PREFILL, l]
                c[ACC] += acc
                c[HIT] += hit
                c[MISS] += acc - hit
                c[LOAD] += loads
                c[EVICT] += evicts
                c[BYPASS] += acc - hit - loads
            for i in range(staging.shape[0]):  # host steps may stream through any row
                if staging[i] >= 0:
                    held[staging[i]] -= 1
                    staging[i] = -1
            first = r + 1
            continue
        ready = r - first - lag + 1       # forwards first..r-1 wait; those lag old are decided
        if ready > 0:
            _decide(keys, row_phase, log, L, parts, cap, first, first + ready, counts, tab, dev,
                    used, held, missed, mark, touched, rounds, out)
            rounds += 1
            first += ready
        ph = row_phase[r]
        for l in range(L):                # the forward as the device meets it
            s = r * L + l
            n = acc = 0
            for j in range(W):
                key = keys[s, j]
                if key < 0:
                    continue
                acc += 1
                if dev[key] < 0:
                    missed[s, j] = True
                    buf[n] = key
                    n += 1
            c = counts[ph, l]
            c[ACC] += acc
            c[HIT] += acc - n
            c[MISS] += n
            miss = np.sort(buf[:n])       # the device stages by expert id
            base = (l % blocks) * width
            for i in range(width):        # the step writes its whole staging block
                old = staging[base + i]
                if old >= 0:
                    held[old] -= 1
                new = miss[i] if i < n else -1
                staging[base + i] = new
                if new >= 0:
                    held[new] += 1
            out[0] += n
    return counts, out


@njit(cache=True)
def _decide(keys, row_phase, log, L, parts, cap, a, b, counts, tab, dev, used, held, missed,
            mark, touched, round_id, out):
    """The table's steps of forwards ``a..b-1`` (``LaggedTable._decide``), then the device
    map brought to the table's over the keys they touched (``_diff``)."""
    W = keys.shape[1]
    nt = 0
    for r in range(a, b):
        ph = row_phase[r]
        for l in range(L):
            s = r * L + l
            p = 0 if parts == 1 else l
            loads = evicts = nmiss = nmiss_loaded = 0
            for j in range(W):
                key = keys[s, j]
                if key < 0:
                    continue
                if missed[s, j]:
                    nmiss += 1
                v = log[s, j]
                if v == NOT_LOADED:
                    continue
                loads += 1
                if missed[s, j]:
                    nmiss_loaded += 1
                if v >= 0:
                    evicts += 1
                    slot = tab[v]
                    tab[v] = -1
                    if mark[v] != round_id:
                        mark[v] = round_id
                        touched[nt] = v
                        nt += 1
                else:
                    slot = p * cap + used[p]
                    used[p] += 1
                tab[key] = slot
                if mark[key] != round_id:
                    mark[key] = round_id
                    touched[nt] = key
                    nt += 1
            c = counts[ph, l]
            c[LOAD] += loads
            c[EVICT] += evicts
            c[BYPASS] += nmiss - nmiss_loaded
    for i in range(nt):
        key = touched[i]
        new = tab[key]
        if new == dev[key]:
            continue
        dev[key] = new
        if new >= 0:
            if held[key] > 0:
                out[1] += 1   # copied on the device from the staging row that holds it
            else:
                out[2] += 1   # copied from the host a second time
