"""Doubly linked lists of keys for the list-ordered kernels (lru, fifo, slru, arc,
s3fifo, next-use).

Every partition owns ``NL`` lists (oldest first); a key sits in at most one list
(``where[key]``, -1 none), so list ``lid = p * NL + i``. The helpers are inlined
into the step loop, so they cost no call and no reference counting.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def new_lists(nkeys: int, nlists: int):
    """``(prev, nxt, head, tail, size, where)``: empty lists over ``nkeys`` keys."""
    return (np.full(nkeys, -1, np.int32), np.full(nkeys, -1, np.int32),
            np.full(nlists, -1, np.int32), np.full(nlists, -1, np.int32),
            np.zeros(nlists, np.int64), np.full(nkeys, -1, np.int32))


@njit(inline="always")
def remove(key, lid, prev, nxt, head, tail, size, where):
    a, b = prev[key], nxt[key]
    if a >= 0:
        nxt[a] = b
    else:
        head[lid] = b
    if b >= 0:
        prev[b] = a
    else:
        tail[lid] = a
    size[lid] -= 1
    where[key] = -1


@njit(inline="always")
def append(key, lid, prev, nxt, head, tail, size, where):
    t = tail[lid]
    prev[key], nxt[key] = t, -1
    if t >= 0:
        nxt[t] = key
    else:
        head[lid] = key
    tail[lid] = key
    size[lid] += 1
    where[key] = lid


@njit(inline="always")
def oldest_unprotected(lid, head, nxt, stamp, s):
    key = head[lid]
    while key >= 0 and stamp[key] == s:
        key = nxt[key]
    return key
