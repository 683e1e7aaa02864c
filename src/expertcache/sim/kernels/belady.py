"""Kernel of ``belady`` (policies/belady.py): Belady's MIN with forced admission.

A min-heap per partition holds each resident key under ``-(next use << 21 | (2**21 - 1
- key))``: the farthest next use first, then the smaller key, the order the policy's
heap pops in, so ties break the same way. A hit re-keys the entry in place.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ...policies.belady import NEVER
from . import heap, skeleton
from .skeleton import hook, specialize

KEY_BITS = 21                            # keys < 2**21 (checked by ``fits``)
_KEY_MASK = (1 << KEY_BITS) - 1
_STEP_MAX = (1 << (62 - KEY_BITS)) - 1   # stands for NEVER; real steps stay far below


def fits(prep) -> bool:
    return prep.L * prep.E < (1 << KEY_BITS)


def run(prep, policy, parts: int, cap: int, admission: tuple) -> np.ndarray:
    """Counts ``[2, L, 6]`` of Belady's MIN at ``cap`` slots per partition."""
    st = (*heap.new_heap(prep.L * prep.E, parts, cap, prep.keys.shape[1]), prep.nexts,
          np.int64(cap))
    return skeleton.run(replay, prep, parts, cap, st, admission)


def next_uses(keys: np.ndarray) -> np.ndarray:
    """``int64 [S, W]``: the next step needing each access's key, or ``NEVER``."""
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


@hook
def _prio(next_use, key):
    return -((min(next_use, _STEP_MAX) << KEY_BITS) | (_KEY_MASK - key))


STATE = ("prio", "hkey", "where", "size", "todo", "nexts", "capacity")


@hook
def on_hit(key, p, s, j, prio, hkey, where, size, todo, nexts, capacity):
    i = where[key]
    prio[p * capacity + i] = _prio(nexts[s, j], key)   # later than before: can only rise to the top
    heap.up(prio, hkey, where, p * capacity, i)


@hook
def find_victim(p, s, stamp, prio, hkey, where, size, todo, nexts, capacity):
    return heap.min_unprotected(prio, hkey, stamp, s, p * capacity, size[p], todo)


@hook
def on_evict(key, p, prio, hkey, where, size, todo, nexts, capacity):
    heap.remove(prio, hkey, where, size, p, p * capacity, key)


@hook
def on_insert(key, p, s, j, prio, hkey, where, size, todo, nexts, capacity):
    heap.push(prio, hkey, where, size, p, p * capacity, key, _prio(nexts[s, j], key))


replay = specialize(globals(), "belady_replay")
