"""Kernel of ``slru`` (policies/slru.py): probation and protected lists per partition."""

from __future__ import annotations

import numpy as np
from numba import njit

from .lists import append, new_lists, oldest_unprotected, remove
from . import skeleton
from .skeleton import hook

PROBATION, PROTECTED = 0, 1   # list ``p * 2 + segment``


def state(policy, nkeys: int, parts: int, cap: int, width: int) -> tuple:
    """Empty segments for ``policy`` (an SLRU: its ``protected_cap``)."""
    return (*new_lists(nkeys, 2 * parts), np.int64(policy.protected_cap))


@hook
def on_hit(key, p, s, j, st):
    prev, nxt, head, tail, size, where, protected_cap = st
    prob, prot = 2 * p + PROBATION, 2 * p + PROTECTED
    lid = where[key]
    remove(key, lid, prev, nxt, head, tail, size, where)
    append(key, prot, prev, nxt, head, tail, size, where)
    if lid == prob and size[prot] > protected_cap:  # demote the oldest protected
        old = head[prot]
        remove(old, prot, prev, nxt, head, tail, size, where)
        append(old, prob, prev, nxt, head, tail, size, where)


@hook
def find_victim(p, s, stamp, st):
    prev, nxt, head, tail, size, where, protected_cap = st
    victim = oldest_unprotected(2 * p + PROBATION, head, nxt, stamp, s)
    if victim < 0:
        victim = oldest_unprotected(2 * p + PROTECTED, head, nxt, stamp, s)
    return victim


@hook
def on_evict(key, p, st):
    prev, nxt, head, tail, size, where, protected_cap = st
    remove(key, where[key], prev, nxt, head, tail, size, where)


@hook
def on_insert(key, p, s, j, st):
    prev, nxt, head, tail, size, where, protected_cap = st
    append(key, 2 * p + PROBATION, prev, nxt, head, tail, size, where)


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
