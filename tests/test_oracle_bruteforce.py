"""``belady+oracle`` (MIN with bypass) equals the true optimum of a cache that may stage a miss
without caching it, found by exhaustive search, on many random tiny traces: steps of several
keys, steps whose keys outnumber the slots, and every step order the simulator replays
(token, batched, grouped). A step's keys are never its victims."""

from __future__ import annotations

import random
from functools import lru_cache

import numpy as np
import pytest

from expertcache import SlotTable
from expertcache.policies.belady import Future
from expertcache.sim.replay import replay
from expertcache.trace.format import Trace
from test_belady_bruteforce import optimum_hits


def optimum_bypass_hits(steps: list[list[int]], capacity: int) -> int:
    """Most hits any schedule achieves when a miss may be bypassed (served, not cached);
    a missed key may take a free slot or evict a resident key its step does not use."""
    flat = [(s, key) for s, keys in enumerate(steps) for key in keys]

    @lru_cache(maxsize=None)
    def best(i: int, resident: frozenset, loaded: frozenset) -> int:
        if i == len(flat):
            return 0
        s, key = flat[i]
        if i + 1 < len(flat) and flat[i + 1][0] != s:
            nxt = frozenset()                # the next access starts a new step
        else:
            nxt = loaded
        if key in resident and key not in loaded:
            return 1 + best(i + 1, resident, nxt)
        options = [best(i + 1, resident, nxt)]                   # bypass
        if len(resident) < capacity:
            options.append(best(i + 1, resident | {key}, nxt | {key} if nxt else nxt))
        for v in resident - set(steps[s]):
            options.append(best(i + 1, (resident - {v}) | {key}, nxt | {key} if nxt else nxt))
        return max(options)

    return best(0, frozenset(), frozenset())


def table_hits(steps: list[list[int]], experts: int, capacity: int, policy: str) -> int:
    eviction, _, admission = policy.partition("+")
    table = SlotTable(2, experts, capacity, eviction=eviction, admission=admission or "always")
    table.bind_future(Future(steps))
    for keys in steps:
        table.step(keys[0] // experts, [k % experts for k in keys])
    return table.stats().total().hits


def random_steps(rng: random.Random, experts: int, capacity: int) -> list[list[int]]:
    """Steps of one layer (key = expert), up to ``capacity + 2`` keys: some outnumber the slots."""
    return [rng.sample(range(experts), rng.randint(1, min(experts, capacity + 2)))
            for _ in range(rng.randint(3, 10))]


@pytest.mark.parametrize("seed", range(5))
def test_min_with_bypass_equals_bruteforce(seed):
    rng = random.Random(seed)
    wide = gained = 0
    for _ in range(50):
        experts, capacity = rng.randint(2, 6), rng.randint(1, 3)
        steps = random_steps(rng, experts, capacity)
        wide += any(len(s) > capacity for s in steps)
        want = optimum_bypass_hits(steps, capacity)
        assert table_hits(steps, experts, capacity, "belady+oracle") == want, steps
        forced = table_hits(steps, experts, capacity, "belady")
        assert forced <= want, steps
        gained += forced < want
    assert wide > 10 and gained > 0  # wide steps were exercised, and bypass mattered


def test_bypass_beats_forced_admission_by_hand():
    # capacity 1: [0] [1] [0]. Forced admission evicts 0 for 1 (no hit); the optimum
    # bypasses 1 and hits 0.
    steps = [[0], [1], [0]]
    assert optimum_hits(steps, 1) == table_hits(steps, 3, 1, "belady") == 0
    assert optimum_bypass_hits(steps, 1) == table_hits(steps, 3, 1, "belady+oracle") == 1


def test_a_steps_keys_are_never_victims():
    # capacity 1, step [1, 0] with 0 resident: 0 stays though 1 is needed sooner, so 1
    # is bypassed there and misses again at the next step.
    steps = [[0], [1, 0], [1], [1], [0]]
    assert table_hits(steps, 3, 1, "belady+oracle") == optimum_bypass_hits(steps, 1) == 2


def grouped(step_tokens: list[int], L: int, E: int, K: int, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    T = sum(step_tokens)
    ex = np.stack([[rng.choice(E, K, replace=False) for _ in range(T)] for _ in range(L)])
    meta = {"num_experts": E, "top_k": K, "n_moe_layers": L, "prefill_steps": "grouped",
            "step_tokens": step_tokens}
    return Trace(ex.astype(np.int16), meta, phase=np.ones(T, np.uint8))


def layer_steps(trace: Trace, layer: int) -> list[list[int]]:
    """One layer's steps as the replay plans them: each step the union of its tokens."""
    out, start = [], 0
    for n in trace.meta["step_tokens"]:
        out.append(list(dict.fromkeys(trace.experts[layer, start:start + n].reshape(-1).tolist())))
        start += n
    return out


@pytest.mark.parametrize("seed", range(4))
def test_sim_kernel_is_exact_on_grouped_and_token_traces(seed):
    # Per-layer partitions make each layer its own cache: the optimum is the sum of the
    # layers' optima. Steps of 1..3 tokens of top-2 over 5 experts outnumber 2 slots.
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3) for _ in range(8)]
    trace = grouped(sizes, L=2, E=5, K=2, seed=seed)
    for order, cap in (("grouped", 2), ("token", 2), ("grouped", 3)):
        t = trace if order == "grouped" else Trace(trace.experts, {**trace.meta, "prefill_steps":
                                                                    "token"}, phase=trace.phases)
        steps = [layer_steps(t, l) if order == "grouped" else
                 [list(dict.fromkeys(r)) for r in t.experts[l].tolist()] for l in range(2)]
        want = sum(optimum_bypass_hits(s, cap) for s in steps)
        for engine in ("fast", "table"):
            got = replay(t, "belady+oracle", 2 * cap, "per-layer", engine=engine)
            assert got.hits == want, (order, cap, engine)


def test_oracle_is_refused_live():
    table = SlotTable(1, 4, 2, eviction="lru", admission="oracle")
    with pytest.raises(ValueError, match="'oracle' is an offline oracle"):
        table.step(0, [1])
