"""``belady`` in the SlotTable equals the true optimum, found by exhaustive search
over every eviction choice, on many random tiny traces, steps of several keys
included (a step's keys are protected, admission is forced)."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest

from expertcache import SlotTable
from expertcache.policies.belady import Future


def optimum_hits(steps: list[list[int]], capacity: int) -> int:
    """Most hits any eviction schedule achieves (every miss is loaded; a step's keys stay)."""
    flat = [(s, key) for s, keys in enumerate(steps) for key in keys]

    @lru_cache(maxsize=None)
    def best(i: int, resident: frozenset) -> int:
        if i == len(flat):
            return 0
        s, key = flat[i]
        if key in resident:
            return 1 + best(i + 1, resident)
        if len(resident) < capacity:
            return best(i + 1, resident | {key})
        step_keys = steps[s]
        return max(best(i + 1, (resident - {v}) | {key}) for v in resident if v not in step_keys)

    return best(0, frozenset())


def belady_hits(steps: list[list[int]], layers: int, experts: int, capacity: int) -> int:
    table = SlotTable(layers, experts, capacity, eviction="belady")
    table.bind_future(Future(steps))
    for keys in steps:
        layer = keys[0] // experts
        table.step(layer, [k % experts for k in keys])
    return table.stats().total().hits


def random_steps(rng: random.Random, layers: int, experts: int, capacity: int) -> list[list[int]]:
    steps = []
    for _ in range(rng.randint(3, 11)):
        layer = rng.randrange(layers)
        k = rng.randint(1, capacity)
        steps.append([layer * experts + e for e in rng.sample(range(experts), min(k, experts))])
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_belady_equals_bruteforce_optimum(seed):
    rng = random.Random(seed)
    several = 0
    for _ in range(60):
        layers, experts, capacity = rng.randint(1, 2), rng.randint(2, 5), rng.randint(1, 3)
        steps = random_steps(rng, layers, experts, capacity)
        several += any(len(s) > 1 for s in steps)
        assert belady_hits(steps, layers, experts, capacity) == optimum_hits(steps, capacity), steps
    assert several > 20  # steps of several keys really were exercised


def test_bruteforce_is_not_trivial():
    # The search itself must beat a naive schedule. By hand (capacity 2): the optimum
    # evicts 1 at the first 2, hits 0, evicts 1 again at 3, hits 0: 2 hits. FIFO always
    # evicts exactly the key needed next: 0 hits.
    steps = [[0], [1], [2], [0], [1], [3], [0], [1]]
    assert optimum_hits(steps, 2) == 2
    fifo = SlotTable(1, 4, 2, eviction="fifo")
    for keys in steps:
        fifo.step(0, keys)
    assert fifo.stats().total().hits == 0


def test_step_protection_matters_to_the_optimum():
    # With capacity 2 and the step [2, 0], key 0 may not be evicted to make room for 2.
    steps = [[0], [1], [2, 0], [1]]
    assert optimum_hits(steps, 2) == belady_hits(steps, 1, 3, 2) == 1
