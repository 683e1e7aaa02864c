"""One indexed min-heap per partition, for the heap-ordered kernels (belady, lfu).

``prio[base + i]`` (int64) and ``hkey[base + i]`` (the key) are entry ``i`` of the
heap of the partition whose slots start at ``base``; ``where[key]`` is the key's
index, -1 when absent, so an entry can change or leave in place. Ties between
equal priorities never arise: kernels pack a tie-break into the priority.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def new_heap(nkeys: int, parts: int, cap: int, width: int):
    """``(prio, hkey, where, size, todo)``: ``parts`` heaps of ``cap`` entries over ``nkeys``
    keys; ``todo`` is the victim search's stack (steps are at most ``width`` keys wide)."""
    return (np.empty(parts * cap, np.int64), np.empty(parts * cap, np.int32),
            np.full(nkeys, -1, np.int32), np.zeros(parts, np.int64),
            np.empty(2 * width + 3, np.int64))


@njit(inline="always")
def up(prio, hkey, where, base, i):
    x, xk = prio[base + i], hkey[base + i]
    while i > 0:
        parent = (i - 1) >> 1
        if prio[base + parent] <= x:
            break
        prio[base + i], hkey[base + i] = prio[base + parent], hkey[base + parent]
        where[hkey[base + i]] = i
        i = parent
    prio[base + i], hkey[base + i] = x, xk
    where[xk] = i


@njit(inline="always")
def down(prio, hkey, where, base, n, i):
    x, xk = prio[base + i], hkey[base + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and prio[base + c + 1] < prio[base + c]:
            c += 1
        if prio[base + c] >= x:
            break
        prio[base + i], hkey[base + i] = prio[base + c], hkey[base + c]
        where[hkey[base + i]] = i
        i = c
    prio[base + i], hkey[base + i] = x, xk
    where[xk] = i


@njit(inline="always")
def push(prio, hkey, where, size, p, base, key, value):
    n = size[p]
    prio[base + n], hkey[base + n] = value, key
    where[key] = n
    size[p] = n + 1
    up(prio, hkey, where, base, n)


@njit(inline="always")
def remove(prio, hkey, where, size, p, base, key):
    v = where[key]
    where[key] = -1
    n = size[p] - 1
    size[p] = n
    if v != n:  # move the last entry into the hole, then restore order
        prio[base + v], hkey[base + v] = prio[base + n], hkey[base + n]
        where[hkey[base + v]] = v
        down(prio, hkey, where, base, n, v)
        up(prio, hkey, where, base, v)


@njit(inline="always")
def min_unprotected(prio, hkey, stamp, s, base, n, todo):
    """Key of the smallest entry whose step is not ``s``, or -1.

    Every entry above it is protected, so it is the best unprotected child reachable
    from the root through protected entries (at most one step's keys of them).
    """
    if n == 0:
        return -1
    if stamp[hkey[base]] != s:  # nearly always: the root itself
        return hkey[base]
    best, top = -1, 1
    todo[0] = 0
    while top > 0:
        top -= 1
        i = todo[top]
        if i >= n:
            continue
        if stamp[hkey[base + i]] != s:
            if best < 0 or prio[base + i] < prio[base + best]:
                best = i
            continue
        todo[top] = 2 * i + 1
        todo[top + 1] = 2 * i + 2
        top += 2
    return -1 if best < 0 else hkey[base + best]
