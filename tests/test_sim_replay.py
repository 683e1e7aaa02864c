"""replay(): hand-traced cases, a golden test with exact miss counts, pinning and
seeding, any registered policy (third-party ones included), and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache import EvictionPolicy, register
from expertcache.sim import Prepared, replay, resolve_policy, slots_for_fraction
from expertcache.stats import DECODE, PREFILL
from expertcache.trace import Trace


def make_trace(steps: list[list[int]], experts: int, phase=None) -> Trace:
    """One layer; ``steps[t]`` are token t's experts."""
    ex = np.array(steps, dtype=np.int16)[None]
    ph = None if phase is None else np.array(phase, np.uint8)
    return Trace(ex, {"num_experts": experts, "top_k": ex.shape[2], "n_moe_layers": 1}, phase=ph)


@pytest.mark.parametrize("engine", ["table", "auto"])
def test_hand_traced_one_key_per_step(engine):
    # 0 1 2 0 1 with 2 slots. LRU: all miss. FIFO: same. Belady at "2" evicts 1
    # (next use 4) over 0 (next use 3), so 0 hits: 4 misses.
    trace = make_trace([[0], [1], [2], [0], [1]], 3)
    got = {p: replay(trace, p, 2, engine=engine).misses for p in ("lru", "fifo", "belady")}
    assert got == {"lru": 5, "fifo": 5, "belady": 4}


@pytest.mark.parametrize("engine", ["table", "auto"])
def test_hand_traced_lru_vs_fifo(engine):
    # 0 1 0 2 0 1, 2 slots. LRU: the hit on 0 refreshes it, so 2 evicts 1, 0 hits
    # again: 4 misses. FIFO: 2 evicts 0 (oldest load), then 0 and 1 miss: 5.
    trace = make_trace([[0], [1], [0], [2], [0], [1]], 3)
    assert replay(trace, "lru", 2, engine=engine).misses == 4
    assert replay(trace, "fifo", 2, engine=engine).misses == 5


@pytest.mark.parametrize("policy", ["lru", "fifo", "belady"])
@pytest.mark.parametrize("engine", ["table", "fast"])
def test_step_protection_and_phases(policy, engine):
    # Steps [0,1] (prefill), [2,0], [1,3] (decode), 2 slots. At step 2 the pool is
    # full and 0 is needed by the same step: it is protected, so 2 evicts 1 and 0
    # hits (plain one-at-a-time LRU would evict 0 and miss it). Step 3 misses both.
    trace = make_trace([[0, 1], [2, 0], [1, 3]], 4, phase=[0, 1, 1])
    r = replay(trace, policy, 2, engine=engine)
    pre, dec = r.stats.total(PREFILL), r.stats.total(DECODE)
    assert (pre.accesses, pre.hits, pre.misses, pre.evictions) == (2, 0, 2, 0)
    assert (dec.accesses, dec.hits, dec.misses, dec.loads, dec.evictions) == (4, 1, 3, 3, 3)
    assert r.hit_rate == pytest.approx(1 / 6)


def golden_trace() -> Trace:
    """Fixed seeded trace: 4 layers x 16 experts, top-2, 300 tokens, Zipf-like popularity."""
    rng = np.random.default_rng(20261202)
    L, E, k, T = 4, 16, 2, 300
    p = np.arange(1, E + 1, dtype=float) ** -1.0
    p /= p.sum()
    ex = np.empty((L, T, k), np.int16)
    for layer in range(L):
        perm = rng.permutation(E)
        for t in range(T):
            ex[layer, t] = perm[rng.choice(E, size=k, replace=False, p=p)]
    phase = (np.arange(T) >= 40).astype(np.uint8)  # 40 prompt tokens, then generation
    return Trace(ex, {"num_experts": E, "top_k": k, "n_moe_layers": L}, phase=phase)


# Misses at 8/16/32 (global) and 12/16/32 (per-layer) slots; 2400 accesses.
GOLDEN = {
    "global": {"lru": [1786, 1388, 720], "fifo": [1955, 1539, 875], "belady": [1299, 784, 344],
               "lru+second-hit": [1788, 1381, 709], "fifo+window": [1947, 1446, 757]},
    "per-layer": {"lru": [1546, 1332, 709], "fifo": [1599, 1420, 820],
                  "belady": [1248, 960, 395], "lru+second-hit": [1539, 1321, 699],
                  "fifo+window": [1522, 1329, 715]},
}
GOLDEN_SLOTS = {"global": (8, 16, 32), "per-layer": (12, 16, 32)}


@pytest.mark.parametrize("partition", sorted(GOLDEN))
def test_golden_miss_counts(partition):
    prep = Prepared(golden_trace())
    got = {policy: [replay(prep, policy, s, partition).misses for s in GOLDEN_SLOTS[partition]]
           for policy in GOLDEN[partition]}
    assert got == GOLDEN[partition]
    assert prep.trace.num_layers * prep.trace.num_tokens * prep.trace.top_k == 2400


def test_pinned_keys_always_hit_and_take_capacity():
    trace = make_trace([[0], [1], [2], [0], [1], [2], [0]], 3)
    free = replay(trace, "lru", 2)
    pinned = replay(trace, "lru", 2, pinned=[0])
    assert pinned.engine == "table" and free.misses == 7
    # 0 is resident from the start (3 hits); 1 and 2 share one slot and always miss.
    assert (pinned.hits, pinned.misses) == (3, 4)


def test_seeded_keys_start_resident_but_can_leave():
    trace = make_trace([[0], [1], [2], [0]], 3)
    seeded = replay(trace, "lru", 2, seed=[0, 1])
    # 0 and 1 hit at once; 2 evicts the least recent (0), so 0 misses at the end.
    assert (seeded.hits, seeded.misses) == (2, 2)


class MostRecent(EvictionPolicy):
    """A policy the simulator has never heard of: evict the most recent key."""

    name = "test-sim-mru"
    description = "most recently used (test only)"

    def __init__(self, capacity, **params):
        super().__init__(capacity)
        self._order = []

    def on_insert(self, key, now):
        self._order.append(key)

    def on_access(self, key, now):
        self._order.remove(key)
        self._order.append(key)

    def on_remove(self, key):
        self._order.remove(key)

    def victim(self, protected):
        return next((k for k in reversed(self._order) if k not in protected), None)


@pytest.fixture
def most_recent():
    from expertcache.policies import registry

    register(MostRecent)
    yield MostRecent
    registry._EVICTION.pop(MostRecent.name, None)  # keep the registry as other tests see it


def test_any_registered_policy_replays_through_the_table(most_recent):
    trace = make_trace([[0], [1], [2], [0], [1], [2]], 3)
    r = replay(trace, "test-sim-mru+second-hit", 2)
    assert (r.policy, r.admission, r.engine) == ("test-sim-mru", "second-hit", "table")
    # MRU: 2 evicts 1 (most recent), 0 hits, 1 evicts 0 (now most recent), 2 hits.
    # LRU would miss all six.
    assert replay(trace, "test-sim-mru", 2).hits == 2
    assert replay(trace, "lru", 2).hits == 0


def test_default_is_labelled_with_the_policy_it_stands_for():
    spec = resolve_policy("default+second-hit")
    assert (spec.eviction, spec.admission) == ("default", "second-hit")
    assert spec.label == "default (next-use)+second-hit"


def test_errors_say_what_to_do():
    trace = make_trace([[0, 1], [1, 2]], 4)
    with pytest.raises(ValueError, match="known eviction policies: .*lru"):
        replay(trace, "nosuch", 4)
    with pytest.raises(ValueError, match="unknown admission policy"):
        replay(trace, "lru+nosuch", 4)
    with pytest.raises(ValueError, match="below top-k"):
        replay(trace, "lru", 1)
    with pytest.raises(ValueError, match="partition"):
        replay(trace, "lru", 4, "weird")
    with pytest.raises(ValueError, match=r"fraction must be between 0 and 1: the share in \(0, 1\]"):
        slots_for_fraction(trace, 1.5)
    with pytest.raises(ValueError, match="engine"):
        replay(trace, "lru", 4, engine="gpu")
    assert slots_for_fraction(trace, 0.5) == 2


def test_sim_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, numpy as np; from expertcache.sim import replay, sweep; "
            "from expertcache.cli import sim; from expertcache.trace import Trace; "
            "t = Trace(np.zeros((1, 3, 1), np.int16), {'num_experts': 2, 'top_k': 1, 'n_moe_layers': 1}); "
            "sweep(t, ['lru', 'belady', 'slru+window'], [1, 2], workers=1); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_without_numba_every_replay_runs_through_the_table(monkeypatch):
    # Without numba (a broken install) the simulator's whole-trace kernels are skipped, and
    # asking for one says what to install.
    from expertcache.policies import kernels

    trace = make_trace([[0, 1], [1, 2], [0, 2]], 4)
    fast = replay(trace, "lru", 2)
    monkeypatch.setattr(kernels, "have_numba", lambda: False)
    slow = replay(trace, "lru", 2)
    assert (fast.engine, slow.engine) == ("lru-kernel", "table")
    assert slow.stats.to_dict() == fast.stats.to_dict()
    with pytest.raises(ValueError, match=r"expertcache\[sim\]"):
        replay(trace, "lru", 2, engine="fast")
