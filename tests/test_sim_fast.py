"""The numba kernels equal the SlotTable path, counter for counter (per layer and
phase: accesses, hits, misses, loads, evictions, bypasses), on many random traces
and on slices of the shared real traces; LRU's one-pass stack distances equal a
SlotTable replay at every size. Every kernel mirrors a policy class in policies/ (one
step loop, policies/kernels/skeleton.py, with each policy's hooks): a change there without
its kernel fails here."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.cache import SlotTable
from expertcache.sim.replay import Prepared, lru_all_sizes, replay
from expertcache.trace import Trace, load_trace

from conftest import shared_trace  # tests/ is on sys.path (not a package)


def random_trace(rng: np.random.Generator) -> Trace:
    L, E = int(rng.integers(1, 5)), int(rng.integers(2, 14))
    k, T = int(rng.integers(1, min(E, 4) + 1)), int(rng.integers(1, 50))
    # Skewed popularity with some repeats inside a step (SlotTable drops them).
    p = rng.dirichlet(np.full(E, 0.5))
    ex = rng.choice(E, size=(L, T, k), p=p).astype(np.int16)
    phase = rng.integers(0, 2, T).astype(np.uint8)
    return Trace(ex, {"num_experts": E, "top_k": k, "n_moe_layers": L}, phase=phase)


def sizes(trace: Trace, partition: str) -> list[int]:
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    per = L if partition == "per-layer" else 1
    caps = {k, k + 1, k + 2, (k + E) // 2, E if partition == "per-layer" else L * E}
    return sorted(c * per for c in caps if c >= k)


def same(a, b) -> bool:
    return a.stats.to_dict() == b.stats.to_dict()


@pytest.mark.parametrize("policy", ["lru", "fifo", "belady", "slru", "arc", "lfu", "s3fifo"])
@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_kernel_equals_slot_table_on_random_traces(policy, partition):
    rng = np.random.default_rng([ord(c) for c in policy + partition])
    for _ in range(40):
        prep = Prepared(random_trace(rng))
        for slots in sizes(prep.trace, partition):
            table = replay(prep, policy, slots, partition, engine="table")
            fast = replay(prep, policy, slots, partition, engine="fast")
            assert fast.engine != "table"
            assert same(table, fast), (policy, partition, slots, prep.trace.experts.tolist())


@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_lru_stack_distances_equal_slot_table_at_every_size(partition):
    rng = np.random.default_rng(11 if partition == "global" else 12)
    for _ in range(40):
        prep = Prepared(random_trace(rng))
        slots = sizes(prep.trace, partition)
        for one_pass in lru_all_sizes(prep, slots, partition):
            table = replay(prep, "lru", one_pass.slots, partition, engine="table")
            assert same(table, one_pass), (partition, one_pass.slots, prep.trace.experts.tolist())


def test_kernels_differ_from_each_other():
    # Agreement must not be vacuous: the three policies give different counts here.
    rng = np.random.default_rng(5)
    ex = rng.choice(32, size=(3, 400, 4), p=rng.dirichlet(np.full(32, 0.3))).astype(np.int16)
    prep = Prepared(Trace(ex, {"num_experts": 32, "top_k": 4, "n_moe_layers": 3}))
    misses = {p: replay(prep, p, 24).misses for p in ("lru", "fifo", "belady")}
    assert len(set(misses.values())) == 3 and misses["belady"] == min(misses.values())


@pytest.mark.parametrize("name", ["code", "general"])
@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_kernels_equal_slot_table_on_real_trace_slices(name, partition):
    prep = Prepared(load_trace(shared_trace(f"qwen3-30b-a3b-{name}.npz")).slice_tokens(150))
    for slots in (384, 1536):
        for one_pass in lru_all_sizes(prep, [slots], partition):
            assert same(replay(prep, "lru", slots, partition, engine="table"), one_pass)
        for policy in ("lru", "fifo", "belady", "lru+second-hit", "fifo+window", "slru", "arc",
                       "lfu", "s3fifo", "next-use", "default"):
            table = replay(prep, policy, slots, partition, engine="table")
            assert same(table, replay(prep, policy, slots, partition, engine="fast")), (policy, slots)


ADMISSIONS = [("second-hit", {}), ("second-hit", {"ghost": 1}), ("second-hit", {"ghost": 5}),
              ("window", {}), ("window", {"n": 1, "w": 1}), ("window", {"n": 3, "w": 4}),
              ("window", {"n": 2, "w": 1})]


@pytest.mark.parametrize("eviction", ["lru", "fifo", "belady", "slru", "arc", "lfu", "s3fifo",
                                      "next-use"])
@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_admission_kernels_equal_slot_table(eviction, partition):
    # Admission is compiled into the one step loop, so every kernel takes every rule.
    rng = np.random.default_rng([ord(c) for c in eviction + partition + "admit"])
    bypassed = 0
    for _ in range(15):
        prep = Prepared(random_trace(rng))
        for admission, params in ADMISSIONS:
            for slots in sizes(prep.trace, partition)[:3]:
                policy = f"{eviction}+{admission}"
                table = replay(prep, policy, slots, partition, engine="table", admission_params=params)
                fast = replay(prep, policy, slots, partition, engine="fast", admission_params=params)
                assert same(table, fast), (policy, params, partition, slots, prep.trace.experts.tolist())
                bypassed += fast.total.bypasses
    assert bypassed > 0  # admission really refused something in these runs


@pytest.mark.parametrize("policy, params", [
    ("slru", {"protected": 0.0}), ("slru", {"protected": 0.3}), ("slru", {"protected": 0.95}),
    ("lfu", {"decay": 1}), ("lfu", {"decay": 3}), ("lfu", {"decay": 10}),
    ("s3fifo", {"small": 0.01}), ("s3fifo", {"small": 0.25}), ("s3fifo", {"small": 0.5}),
    ("s3fifo", {"small": 0.9})])
def test_kernels_follow_policy_parameters(policy, params):
    rng = np.random.default_rng([ord(c) for c in policy + repr(params)])
    for _ in range(15):
        prep = Prepared(random_trace(rng))
        for partition in ("global", "per-layer"):
            for slots in sizes(prep.trace, partition):
                table = replay(prep, policy, slots, partition, engine="table", eviction_params=params)
                fast = replay(prep, policy, slots, partition, engine="fast", eviction_params=params)
                assert same(table, fast), (policy, params, slots, prep.trace.experts.tolist())


def test_auto_engine_falls_back_to_the_table_when_no_kernel_applies():
    prep = Prepared(random_trace(np.random.default_rng(3)))
    k, L = prep.trace.top_k, prep.trace.num_layers
    slots = (k + 1) * L
    # never is a compiled rule (NEVER in skeleton.py) since admission is written once; a
    # plug-in policy (lfru) is what still falls back to the table.
    assert replay(prep, "lfru", slots).engine == "table"
    never = replay(prep, "lru+never", slots)
    assert never.engine == "lru-kernel"
    assert never.stats.to_dict() == replay(prep, "lru+never", slots, engine="table").stats.to_dict()
    assert replay(prep, "s3fifo", slots).engine == "s3fifo-kernel"
    assert replay(prep, "s3fifo+second-hit", slots).engine == "s3fifo-kernel"
    assert replay(prep, "default", slots).engine == "default-kernel"
    assert replay(prep, "lru", slots, seed=[0]).engine == "table"
    assert replay(prep, "lru", slots, pinned=[0]).engine == "table"
    assert replay(prep, "lru", slots).engine == "lru-kernel"
    assert replay(prep, "fifo+window", slots).engine == "fifo-kernel"
    with pytest.raises(ValueError, match="no fast kernel"):
        replay(prep, "lfru", slots, engine="fast")


def test_a_subclass_that_overrides_a_hook_is_refused_not_silently_compiled():
    # A built-in's logic is its kernel (policies/kernels): a subclass that writes a hook of
    # its own would be ignored by the compiled step, so it is refused wherever it would run;
    # a subclass that changes nothing still runs the kernel.
    from expertcache.policies import registry
    from expertcache.policies.admission import SecondHit
    from expertcache.policies.lru import LRU
    from expertcache.sim.replay import resolve_policy
    from expertcache.policies.kernels import kernel_module

    class Touchy(LRU):  # on_access differs: the lru kernel no longer reproduces it
        name = "test-touchy"

        def on_access(self, key, now):
            pass

    class Same(LRU):  # nothing overridden: the kernel still applies
        name = "test-same"

    class Picky(SecondHit):
        name = "test-picky"

        def admit(self, candidate, victim):
            return False

    for cls in (Touchy, Same, Picky):
        registry.register(cls)
    try:
        prep = Prepared(random_trace(np.random.default_rng(4)))
        slots = (prep.trace.top_k + 1) * prep.trace.num_layers
        with pytest.raises(TypeError, match="overrides on_access"):
            replay(prep, "test-touchy", slots)
        with pytest.raises(TypeError, match="overrides on_access"):
            SlotTable(2, 4, 4, eviction="test-touchy")
        assert replay(prep, "test-same", slots).engine == "test-same-kernel"
        with pytest.raises(TypeError, match="overrides admit"):
            replay(prep, "lru+test-picky", slots)
        spec = resolve_policy("test-same+second-hit")
        assert kernel_module(spec.eviction_cls).__name__.endswith(".lru")
    finally:
        for cls in (Touchy, Same, Picky):
            (registry._EVICTION if cls is not Picky else registry._ADMISSION).pop(cls.name)


# -- next-use (policies/next_use.py) ------------------------------------------
# Short random traces never reach its first score rebuild (every 512 reuses) nor a
# histogram halving (65536), so these runs shrink both: the learned scores, their
# rebuilds and the halving are then exercised on every trace.
@pytest.mark.parametrize("rebuild, halve", [(1, 4), (3, 6), (7, 1 << 16)])
@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_next_use_kernel_equals_slot_table_while_learning(rebuild, halve, partition, monkeypatch):
    from expertcache.policies.next_use import NextUse
    monkeypatch.setattr(NextUse, "rebuild_every", rebuild)
    monkeypatch.setattr(NextUse, "halve_every", halve)
    rng = np.random.default_rng([rebuild, halve, len(partition)])
    unlike_lru = 0
    for _ in range(20):
        prep = Prepared(random_trace(rng))
        for slots in sizes(prep.trace, partition):
            for params in ({}, {"window": 2.0, "horizon": 1}):
                table = replay(prep, "next-use", slots, partition, engine="table", eviction_params=params)
                fast = replay(prep, "next-use", slots, partition, engine="fast", eviction_params=params)
                assert fast.engine == "next-use-kernel"
                assert same(table, fast), (rebuild, halve, params, slots, prep.trace.experts.tolist())
                unlike_lru += fast.misses != replay(prep, "lru", slots, partition).misses
    assert unlike_lru > 0  # the learned scores really chose other victims than LRU


@pytest.mark.slow
@pytest.mark.parametrize("partition", ["global", "per-layer"])
def test_next_use_kernel_equals_slot_table_on_a_long_real_slice(partition):
    # 1500 tokens: ~575k accesses, so the global pool also halves its histogram (every
    # 65536 reuses) several times, as full-trace sweeps do.
    prep = Prepared(load_trace(shared_trace("qwen3-30b-a3b-general.npz")).slice_tokens(1500))
    for slots in (768, 1536):
        table = replay(prep, "default", slots, partition, engine="table")
        assert same(table, replay(prep, "default", slots, partition, engine="fast")), slots
