"""The step every compiled policy runs, written once (numba): admission, hit, victim, insert.

``SlotTable`` runs one step per call (``step``); the simulator runs a whole trace in one
call (``replay``, the same step in a loop). Both go through a policy module's own
entry points (``replay``, ``step``, ``seed``), which pass its hooks in
(``policies/kernels/lru.py`` ends with them). Those few lines are written out in each
module on purpose: numba caches a function by its module and name, and an entry point
made by a factory here would be a closure, which numba's cache neither tells apart by
its hooks nor reloads (tried: every process recompiled).

Per step its keys are protected (``stamp[key] == s``); per key, admission records the
access, a resident key is a hit (a pinned one is not shown to the policy), a miss takes
a free slot or the policy's victim (or is bypassed: every resident key protected, or
admission said no), then the key is inserted. Counts go to ``int64 [2, L, 6]`` (phase,
layer, ``stats.FIELDS``), the layout ``stats.Stats`` wraps; what happened to each key
goes to ``out`` (``out[0, j]`` HIT / LOAD / BYPASS, ``out[1, j]`` the key it evicted or
-1), which ``SlotTable`` turns into a ``Plan`` with slot numbers.

A policy module holds its state as a tuple ``st`` of arrays and defines four hooks, the
``EvictionPolicy`` calls, each taking ``st`` last:

- ``on_hit(key, p, s, j, st)``: ``on_access`` (``p`` partition, ``s`` step, ``j`` the
  key's column in the step's row, -1 outside a step);
- ``find_victim(p, s, stamp, st) -> key or -1``: ``victim``, a pure query that never
  picks a key with ``stamp[key] == s``;
- ``on_evict(key, p, st)``: ``on_remove``;
- ``on_insert(key, p, s, j, st)``: ``on_insert``.

The hooks and this loop are ``inline="always"``: each policy's entry points compile
into one function with no calls and (``_nrt=False``) no reference counting, which made
the loop 3-10x faster than calls. Numba's cache keys an entry point on its own module's
file: after editing this file, ``lists.py`` or ``heap.py``, clear the kernels'
``__pycache__`` (a changed policy module recompiles by itself).

Admission is part of the step, chosen by the rule code ``adm[0]``
(``AdmissionPolicy.kernel``): ``ALWAYS``; ``NEVER``; ``SECOND_HIT`` keeps a ghost LRU
list of ``ghost`` keys per partition, touched by every access; ``WINDOW`` admits a key
used ``n_uses`` times within its layer's last ``window`` steps. Either only decides when
the miss would evict. ``FREQ`` (TinyLFU-style) counts every key's accesses, halving all
counts every ``reset`` accesses, and in a step of more than ``narrow`` keys (a batch)
admits a miss that would evict only if its key's count beats the victim's. ``ORACLE``
reads the future (replays only, as ``belady`` does): a miss that would evict is admitted
only if the victim is needed later than the key, and a step's keys are taken soonest
needed first, so that a full step keeps the keys needed soonest (with ``belady``
eviction: MIN with bypass, the optimum of a cache that may stage a miss without caching
it). Both decide once the victim is known, in the step below. ``replay`` holds a copy of the loop for
``always`` with the rule a constant (a run-time rule cost an LRU replay 15-25%) and one
for the others; ``step``, one call per step of a live table, reads the rule at run time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

ALWAYS, SECOND_HIT, WINDOW, NEVER, ORACLE, FREQ = 0, 1, 2, 3, 4, 5
ACC, HIT, MISS, LOAD, EVICT, BYPASS = range(6)
# out[0, j]: what happened to the step's key j (PAD: no key in that column).
PAD, IS_HIT, IS_LOAD, IS_BYPASS = -1, 0, 1, 2
# replay_log's log[s, j]: the key column j's load evicted, FREE (-1: it took a free slot) or
# NOT_LOADED (a hit, a bypass or no key).
FREE, NOT_LOADED = -1, -2
# admission's answer for one access: NO (bypass), FREE_ONLY (only into a free slot), YES.
NO, FREE_ONLY, YES = 0, 1, 2


def hook(fn):
    """Decorator for a policy's hooks: inlined into the step (no call, no refcounts)."""
    return njit(inline="always")(fn)


def scratch(L: int, nkeys: int, parts: int, width: int) -> tuple:
    """The step's own arrays: counts, residency, used slots per partition, protection
    stamps, pins and the ``out`` of one step. The loop allocates nothing itself."""
    return (np.zeros((2, L, 6), np.int64),         # counts
            np.zeros(nkeys, np.bool_),             # resident
            np.zeros(parts, np.int64),             # used slots per partition
            np.full(nkeys, -1, np.int32),          # stamp: step that last needed the key
            np.zeros(nkeys, np.bool_),             # pinned: resident, never shown to the policy
            np.full((2, max(width, 1)), PAD, np.int32))  # out of the latest step


def admission_state(rule: int, nkeys: int, parts: int, ghost: int = 1, n_uses: int = 1,
                    window: int = 1, future: tuple | None = None, width: int = 1,
                    reset: int = 1, narrow: int = 0) -> tuple:
    """``adm``: the rule code, its parameters and its arrays (sized 1 when unused).
    ``future`` is ``(starts, uses)`` (``Future.arrays``) for ``ORACLE``, ``width`` the widest
    step it will see; ``FREQ`` counts halve every ``reset`` accesses and steps of at most
    ``narrow`` keys skip its comparison."""
    ghosts = nkeys if rule == SECOND_HIT else 1
    ring = nkeys if rule == WINDOW else 1
    if future is None:
        future = (np.zeros(2, np.int64), np.zeros(1, np.int64))
    starts, uses = future
    wide = max(width, 1) if rule == ORACLE else 1
    return (np.int64(rule), np.int64(ghost), np.int64(n_uses), np.int64(window),
            # second-hit: a ghost LRU list per partition, oldest first
            np.full(ghosts, -1, np.int32), np.full(ghosts, -1, np.int32),
            np.full(parts, -1, np.int32), np.full(parts, -1, np.int32),
            np.zeros(parts, np.int64), np.zeros(ghosts, np.bool_),
            # window: the last n_uses use times (the layer's step count) per key, as a ring
            np.full((ring, max(n_uses, 1)), -(1 << 40), np.int64), np.zeros(ring, np.int64),
            # oracle: every key's use steps (CSR), a cursor per key, the step's visit order
            # and its keys' next uses
            starts, uses, starts[:-1].copy(), np.zeros(wide, np.int32), np.zeros(wide, np.int64),
            # freq: every key's access count, halved each ``reset`` accesses; accesses since
            np.zeros(nkeys if rule == FREQ else 1, np.int64), np.zeros(1, np.int64),
            np.int64(max(reset, 1)), np.int64(narrow))


FAR = 1 << 62  # next use of a key never used again (policies.belady.NEVER)


@njit(inline="always")
def next_use(key, s, adm):
    """The first step after ``s`` that uses ``key`` (FAR if none); steps only move forward,
    so each key's cursor does too."""
    starts, uses, cursor = adm[12], adm[13], adm[14]
    if key + 1 >= starts.shape[0]:
        return FAR
    i, end = cursor[key], starts[key + 1]
    while i < end and uses[i] <= s:
        i += 1
    cursor[key] = i
    return uses[i] if i < end else FAR


@njit(inline="always")
def later(a, b, s, adm):
    """Whether ``a`` is needed later than ``b`` after step ``s``: the first use that differs
    decides (a step needs many keys at once, so next uses tie often, and then the use after
    decides which is worth its slot). Both cursors are current (``next_use`` was asked)."""
    starts, uses, cursor = adm[12], adm[13], adm[14]
    if a + 1 >= starts.shape[0]:
        return b + 1 < starts.shape[0] and cursor[b] < starts[b + 1]
    if b + 1 >= starts.shape[0]:
        return False
    return uses_later(uses, cursor[a], cursor[b], starts[a + 1], starts[b + 1])


@njit(inline="always")
def uses_later(uses, i, j, ea, eb):
    """Whether the uses ``uses[i:ea]`` of one key come later than ``uses[j:eb]`` of another:
    the first that differ decide; a key with no use left is the later one."""
    while i < ea and j < eb:
        if uses[i] != uses[j]:
            return uses[i] > uses[j]
        i += 1
        j += 1
    return i == ea and j < eb


@njit(inline="always")
def _count(key, adm):
    """``FREQ``: one more access of ``key``; every ``reset`` accesses all counts halve (the
    TinyLFU reset: old popularity fades)."""
    counts, total, reset = adm[17], adm[18], adm[19]
    counts[key] += 1
    total[0] += 1
    if total[0] >= reset:
        total[0] = 0
        for k in range(counts.shape[0]):
            counts[k] >>= 1


@njit(inline="always")
def _evicts(victim, key, key_next, s, adm):
    """``ORACLE``: whether ``key`` is worth ``victim``'s slot (the victim is needed later)."""
    v = next_use(victim, s, adm)
    return v > key_next or (v == key_next and later(victim, key, s, adm))


@njit(inline="always")
def oracle_order(row, s, adm):
    """``ORACLE``: the step's columns by future use, soonest first (insertion sort: a step
    holds a few hundred keys at most), into ``adm``'s order; their next uses alongside."""
    order, nu = adm[15], adm[16]
    n = 0
    for j in range(row.shape[0]):
        if row[j] < 0:
            continue
        v = next_use(row[j], s, adm)
        i = n
        while i > 0 and (nu[i - 1] > v or (nu[i - 1] == v and
                                           later(row[order[i - 1]], row[j], s, adm))):
            nu[i], order[i] = nu[i - 1], order[i - 1]
            i -= 1
        nu[i], order[i] = v, j
        n += 1
    return n


@njit(inline="always")
def admission(key, p, token, adm, rule):
    """Record one access; NO, FREE_ONLY or YES should it miss (``AdmissionPolicy``). ``rule``
    is ``adm[0]``, passed apart so that a caller can make it a constant."""
    _, ghost, n_uses, window_steps, gprev, gnext, ghead, gtail, gsize, in_ghost, uses, nuse = adm[:12]
    if rule == ALWAYS or rule == ORACLE:  # the oracle decides once it knows the victim
        return YES
    if rule == FREQ:                      # so does freq; here it counts
        _count(key, adm)
        return YES
    if rule == NEVER:
        return NO
    if rule == SECOND_HIT:
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
        return YES if ok else FREE_ONLY
    n = nuse[key]  # WINDOW
    uses[key, n % n_uses] = token
    nuse[key] = n + 1
    # n_uses uses within the window iff the oldest in the ring is in it
    return YES if uses[key, (n + 1) % n_uses] > token - window_steps else FREE_ONLY


@njit(inline="always")
def step(row, s, layer, token, phase, p, cap, st, sc, adm, on_hit, find_victim, on_evict,
         on_insert):
    """One step of a live table: ``row`` int32 keys (-1 = none), step number ``s``, the
    layer's own step count ``token``, partition ``p`` of ``cap`` slots. Counts into
    ``sc``'s counts, and what happened to each key into its ``out``."""
    _step(row, s, layer, token, phase, p, cap, st, sc, adm, on_hit, find_victim, on_evict,
          on_insert, adm[0], True)


@njit(inline="always")
def _step(row, s, layer, token, phase, p, cap, st, sc, adm, on_hit, find_victim, on_evict,
          on_insert, rule, live):
    """``step``; ``rule`` (``adm[0]``) and ``live`` are constants where ``replay`` inlines
    this, so its loop keeps only its own rule's branch and skips what only a live table
    needs: the per-key ``out`` and the pins (a replay has none)."""
    counts, resident, used, stamp, pinned, out = sc
    K = row.shape[0]
    for j in range(K):
        if row[j] >= 0:
            stamp[row[j]] = s
    acc = hit = evict = bypass = 0
    weigh = False
    if rule == FREQ:  # one token's keys (a single stream) are admitted: recency rules there
        n = 0
        for j in range(K):
            n += row[j] >= 0
        weigh = n > adm[20]
    if live:
        for j in range(K):
            out[1, j] = -1
            out[0, j] = PAD
    n = K
    if rule == ORACLE:
        n = oracle_order(row, s, adm)
    for jj in range(n):
        j = adm[15][jj] if rule == ORACLE else jj
        key = row[j]
        if key < 0:
            continue
        acc += 1
        ok = admission(key, p, token, adm, rule)
        if resident[key]:
            hit += 1
            if live:
                out[0, j] = IS_HIT
                if pinned[key]:
                    continue
            on_hit(key, p, s, j, st)
            continue
        if live:
            out[0, j] = IS_BYPASS
        if used[p] < cap:
            if ok == NO:
                bypass += 1
                continue
            used[p] += 1
        else:
            victim = find_victim(p, s, stamp, st)
            if victim < 0 or ok != YES:  # all protected, or admission said no
                bypass += 1
                continue
            if rule == ORACLE and not _evicts(victim, key, adm[16][jj], s, adm):
                bypass += 1      # the victim is needed no later than the key: keep it
                continue
            if rule == FREQ and weigh and adm[17][key] <= adm[17][victim]:
                bypass += 1      # the victim was used as often: a sweep must not flush it
                continue
            on_evict(victim, p, st)
            resident[victim] = False
            if live:
                out[1, j] = victim
            evict += 1
        on_insert(key, p, s, j, st)
        resident[key] = True
        if live:
            out[0, j] = IS_LOAD
    c = counts[phase, layer]
    c[ACC] += acc
    c[HIT] += hit
    c[MISS] += acc - hit
    c[LOAD] += acc - hit - bypass
    c[EVICT] += evict
    c[BYPASS] += bypass


@njit(inline="always")
def replay(keys, phases, L, parts, cap, st, sc, adm, on_hit, find_victim, on_evict, on_insert):
    """``step`` over every row of ``keys`` (token-major: row ``s`` is layer ``s % L``). The
    loop is compiled twice: for admission ``always`` with the rule a constant (the other
    rules' branches vanish: 15-25% of an LRU replay), and for any rule read at run time
    (a copy per rule cost too much compile time for next-use)."""
    if adm[0] == ALWAYS:
        _loop(keys, phases, L, parts, cap, st, sc, adm, on_hit, find_victim, on_evict,
              on_insert, ALWAYS)
    else:
        _loop(keys, phases, L, parts, cap, st, sc, adm, on_hit, find_victim, on_evict,
              on_insert, adm[0])


@njit(inline="always")
def _loop(keys, phases, L, parts, cap, st, sc, adm, on_hit, find_victim, on_evict, on_insert,
          rule):
    layer, token = L - 1, -1
    for s in range(keys.shape[0]):
        if layer == L - 1:                           # layer = s % L, token = s // L (the
            layer, token = 0, token + 1              # layer's own step count), no division
        else:
            layer += 1
        p = 0 if parts == 1 else layer
        _step(keys[s], s, layer, token, phases[s], p, cap, st, sc, adm, on_hit, find_victim,
              on_evict, on_insert, rule, False)


@njit(inline="always")
def replay_log(keys, phases, L, parts, cap, st, sc, adm, log, on_hit, find_victim, on_evict,
               on_insert):
    """``replay`` that also writes what each step did: ``log[s, j]`` is the key the load of
    row ``s``'s column ``j`` evicted, FREE or NOT_LOADED. ``sim/lag.py`` replays a device one or
    more forwards behind from it (the table's own steps do not change with the lag, only
    when the device sees them). ``sc``'s ``out`` must be as wide as ``keys``."""
    out = sc[5]
    layer, token = L - 1, -1
    for s in range(keys.shape[0]):
        if layer == L - 1:
            layer, token = 0, token + 1
        else:
            layer += 1
        p = 0 if parts == 1 else layer
        _step(keys[s], s, layer, token, phases[s], p, cap, st, sc, adm, on_hit, find_victim,
              on_evict, on_insert, adm[0], True)
        for j in range(keys.shape[1]):
            log[s, j] = out[1, j] if out[0, j] == IS_LOAD else NOT_LOADED


@njit(inline="always")
def seed(keys, loaded, s, parts, num_experts, cap, st, sc, on_insert):
    """Preload ``keys`` into free slots (``SlotTable.seed``): inserted, not counted.
    ``loaded[j]`` says whether key j was loaded (else it was resident or no slot was free)."""
    resident, used = sc[1], sc[2]
    for j in range(keys.shape[0]):
        key = keys[j]
        p = 0 if parts == 1 else key // num_experts
        loaded[j] = False
        if resident[key] or used[p] >= cap:
            continue
        used[p] += 1
        on_insert(key, p, s, -1, st)
        resident[key] = True
        loaded[j] = True


@njit(cache=True)
def admit_row(row, p, token, adm, ok):
    """Admission alone over one step's keys (for a plug-in eviction policy's table)."""
    for j in range(row.shape[0]):
        ok[j] = admission(row[j], p, token, adm, adm[0]) if row[j] >= 0 else NO
