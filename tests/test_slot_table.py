"""SlotTable behaviour: partitions, pinned keys, bypass of oversized steps, slot
reuse, seeding, per-phase stats, and clear errors for bad input."""

from __future__ import annotations

import pytest

from expertcache import SlotTable
from expertcache.stats import DECODE, PREFILL


def test_per_layer_partitions_are_equal_and_independent():
    table = SlotTable(2, 8, 4, eviction="lru", partition="per-layer")
    assert table.partition_capacity == 2
    table.step(1, [0, 1])
    for e in range(8):  # churn layer 0 only
        table.step(0, [e])
    assert table.step(1, [0, 1]).hits == {8: 2, 9: 3}  # layer 1 owns slots 2, 3
    assert all(0 <= s < 2 for k, s in table.resident().items() if k < 8)


def test_global_pool_is_shared_between_layers():
    table = SlotTable(2, 8, 2, eviction="lru")
    table.step(1, [0, 1])
    plan = table.step(0, [5])
    assert plan.evictions == {8: 0} and plan.loads == {5: 0}  # layer 0 took layer 1's slot


def test_freed_slots_are_reused_and_keys_keep_their_slot():
    table = SlotTable(1, 8, 3, eviction="lru")
    assert table.step(0, [0, 1, 2]).loads == {0: 0, 1: 1, 2: 2}  # lowest free slot first
    plan = table.step(0, [3])
    assert plan.evictions == {0: 0} and plan.loads == {3: 0}
    assert table.step(0, [1, 2]).hits == {1: 1, 2: 2}


def test_a_step_larger_than_the_partition_bypasses_the_excess():
    table = SlotTable(1, 8, 2, eviction="lru")
    plan = table.step(0, [4, 5, 6])
    assert plan.loads == {4: 0, 5: 1} and plan.bypasses == [6] and not plan.evictions
    c = table.stats().total()
    assert (c.accesses, c.hits, c.misses, c.loads, c.bypasses) == (3, 0, 3, 2, 1)


def test_repeated_experts_in_a_step_count_once():
    table = SlotTable(1, 8, 4)
    plan = table.step(0, [3, 3, 1, 3])
    assert list(plan.loads) == [3, 1] and table.stats().total().accesses == 2


def test_pinned_keys_count_against_capacity_and_stay():
    table = SlotTable(2, 4, 3, eviction="fifo", pinned=[(1, 2), 0])
    assert table.pinned == {6, 0} and table.resident() == {6: 0, 0: 1}
    for e in (1, 2, 3, 1, 2, 3):
        plan = table.step(0, [e])
        assert not set(plan.evictions) & {0, 6}
    assert table.step(1, [2]).hits == {6: 0}
    assert table.step(0, [0]).hits == {0: 1}


def test_static_policy_pins_through_the_table():
    table = SlotTable(2, 4, 4, eviction="static", eviction_params={"keys": [1, 5]}, partition="per-layer")
    assert table.resident() == {1: 0, 5: 2}  # each pinned key in its own layer's partition


def test_seed_preloads_evictable_keys_without_counting():
    table = SlotTable(1, 8, 2, eviction="lru")
    assert table.seed([5, (0, 6), 7]).loads == {5: 0, 6: 1}  # 7 does not fit: skipped
    assert table.stats().total().accesses == 0
    assert table.step(0, [6]).hits == {6: 1}
    assert table.step(0, [1]).evictions == {5: 0}


def test_stats_are_kept_per_phase_and_layer():
    table = SlotTable(2, 4, 4)
    table.step(0, [0, 1], phase="prefill")
    table.step(0, [0, 2])
    table.step(1, [3], phase=PREFILL)
    s = table.stats()
    assert s.layer(0, PREFILL).accesses == 2 and s.layer(0, PREFILL).hits == 0
    assert s.layer(0, DECODE).hits == 1 and s.layer(0, DECODE).misses == 1
    assert s.total(PREFILL).accesses == 3 and s.total().accesses == 5
    d = s.to_dict()
    assert d["decode"]["hit_rate"] == 0.5 and d["layers"][1]["prefill"]["loads"] == 1
    table.reset_stats()
    assert table.stats().total().accesses == 0 and table.slot_of(3 + 4) is not None


def test_belady_without_the_future_refuses_clearly():
    table = SlotTable(1, 4, 2, eviction="belady")
    with pytest.raises(ValueError, match="offline oracle.*future"):
        table.step(0, [0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(slots=7, top_k=8), "capacity below top-k.*at least 8"),
    (dict(slots=8, top_k=3, partition="per-layer"), "capacity below top-k.*each layer.*at least 12"),
    (dict(slots=3, partition="per-layer"), "no slot per layer.*at least 4"),
    (dict(slots=8, partition="ring"), "unknown partition 'ring'"),
    (dict(slots=8, top_k=20), "top_k=20 exceeds num_experts=16"),
    (dict(slots=0), "slots must be a positive whole number"),
    (dict(slots="8"), "slots must be a positive whole number"),
    (dict(slots=8, pinned=[(4, 0)]), "layer 4, expert 0"),
    (dict(slots=8, pinned=[64]), "out of range 0..63"),
    (dict(slots=2, pinned=[0, 1, 2]), "too many pinned experts"),
    (dict(slots=8, pinned=[2.5]), "expert key must be a whole number"),
    (dict(slots=8, pinned=[(1, "x")]), "expert must be a whole number"),
    (dict(slots=8, eviction="static", eviction_params={"keys": "99"}), "out of range"),
    (dict(slots=8, eviction_params={"decay": 3}), "has no parameter"),
])
def test_bad_construction_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SlotTable(4, 16, **kwargs)


@pytest.mark.parametrize("layer, experts, phase, match", [
    (4, [0], 1, "layer 4 out of range 0..3"),
    (-1, [0], 1, "layer -1 out of range"),
    (0, [3, 16], 1, r"expert id\(s\) \[16\] out of range 0..15"),
    (0, [-2], 1, r"\[-2\] out of range"),
    (0, [1], "warmup", "unknown phase 'warmup'"),
])
def test_bad_steps_are_clear_value_errors(layer, experts, phase, match):
    table = SlotTable(4, 16, 8)
    with pytest.raises(ValueError, match=match):
        table.step(layer, experts, phase)
    assert table.stats().total().accesses == 0  # nothing half-done


def test_num_layers_and_experts_must_be_positive():
    with pytest.raises(ValueError, match="num_layers"):
        SlotTable(0, 8, 8)
    with pytest.raises(ValueError, match="num_experts"):
        SlotTable(2, 2.5, 8)


def _python_policy(name: str, reorder: bool):
    """A registered plug-in LRU (``reorder``: a hit moves the key to the back) or FIFO, written
    in Python: the reference the compiled and the lookup-only tables are checked against."""
    from collections import OrderedDict

    from expertcache.policies.base import EvictionPolicy
    from expertcache.policies.registry import register

    class Slow(EvictionPolicy):
        def __init__(self, capacity, **params):
            super().__init__(capacity)
            self.order = OrderedDict()

        def on_insert(self, key, now):
            self.order[key] = None

        def on_access(self, key, now):
            if reorder:
                self.order.move_to_end(key)

        def on_remove(self, key):
            del self.order[key]

        def victim(self, protected):
            return next((k for k in self.order if k not in protected), None)

    Slow.name = name
    register(Slow)
    return Slow


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_compiled_and_plugin_paths_give_the_same_plans(name):
    # Built-ins run compiled, plug-ins through their Python methods (the key-only hook
    # shortcut is gone with the Python LRU). The same LRU / FIFO written as a plug-in must
    # give the same plans, step for step, pins included.
    import random

    from expertcache.policies import registry

    Slow = _python_policy(f"test-slow-{name}", reorder=name == "lru")
    try:
        fast = SlotTable(2, 8, 5, eviction=name, pinned=[3])
        slow = SlotTable(2, 8, 5, eviction=Slow.name, pinned=[3])
        rng = random.Random(1)
        for _ in range(400):
            layer, experts = rng.randrange(2), rng.sample(range(8), rng.randint(1, 4))
            a, b = fast.step(layer, experts), slow.step(layer, experts)
            assert (a.hits, a.loads, a.evictions, a.bypasses) == (b.hits, b.loads, b.evictions, b.bypasses)
        assert fast.stats().to_dict() == slow.stats().to_dict()
    finally:
        registry._EVICTION.pop(Slow.name)


def test_numpy_expert_ids_give_plain_int_keys():
    # Traces store int16 ids; layer * E + id must not be computed in int16 (99*512 overflows).
    np = pytest.importorskip("numpy")
    table = SlotTable(100, 512, 1000)
    plan = table.step(99, np.array([500, 7, 500], dtype=np.int16))
    assert plan.loads == {99 * 512 + 500: 0, 99 * 512 + 7: 1}
    assert all(type(k) is int for k in table.resident())
    table.seed([np.int64(3)])
    assert type(next(iter(table.seed([np.int64(4)]).loads))) is int


def test_pin_before_the_first_step_keeps_keys_for_good():
    table = SlotTable(2, 4, 4, eviction="lru")
    plan = table.pin([(1, 2), 0, 6])  # (1, 2) is key 6 again: pinned once
    assert plan.loads == {6: 0, 0: 1} and table.pinned == {0, 6}
    assert table.pin([0]).loads == {}  # already pinned: nothing to copy
    for e in (1, 2, 3, 1, 2, 3):  # two dynamic slots churn; the pins never leave
        assert not set(table.step(0, [e]).evictions) & {0, 6}
    assert table.step(1, [2, 0]).hits == {6: 0}
    assert table.resident()[0] == 1


def test_pin_equals_the_constructor_pinned_argument():
    seq = [[0], [1, 2], [3], [0, 3], [2], [1], [5, 6], [0]]
    by_ctor = SlotTable(1, 8, 3, eviction="fifo", pinned=[2])
    by_pin = SlotTable(1, 8, 3, eviction="fifo")
    by_pin.pin([2])
    for step in seq:
        assert repr(by_ctor.step(0, step)) == repr(by_pin.step(0, step))
    assert by_ctor.stats().to_dict() == by_pin.stats().to_dict()


def test_pin_per_layer_goes_to_the_keys_own_partition():
    table = SlotTable(2, 8, 4, partition="per-layer")
    assert table.pin([(1, 3)]).loads == {11: 2}  # layer 1 owns slots 2, 3


@pytest.mark.parametrize("prepare", ["step", "seed"])
def test_pin_after_a_step_or_seed_is_refused(prepare):
    table = SlotTable(1, 8, 4)
    table.step(0, [1]) if prepare == "step" else table.seed([1])
    with pytest.raises(ValueError, match="fresh table.*before the first step"):
        table.pin([2])
    assert table.pinned == frozenset()


def test_pin_after_reset_stats_is_still_refused():
    # reset_stats clears counters, not residency: the table is no longer fresh.
    table = SlotTable(1, 8, 4)
    table.step(0, [1])
    table.reset_stats()
    with pytest.raises(ValueError, match="fresh table"):
        table.pin([2])


def test_pin_that_does_not_fit_pins_nothing():
    table = SlotTable(2, 4, 4, partition="per-layer")
    with pytest.raises(ValueError, match=r"too many pinned experts.*2 slots"):
        table.pin([0, (1, 0), 1, 2])  # layer 0 has 2 slots, asked for 3
    assert table.pinned == frozenset() and table.resident() == {}
    assert table.pin([0, 1]).loads == {0: 0, 1: 1}


@pytest.mark.parametrize("keys, error, match", [
    ([8], ValueError, r"expert key 8 out of range 0\.\.7"),
    ([(2, 0)], ValueError, "layer 2, expert 0"),
    ([(0, 1, 2)], ValueError, r"\(layer, expert\)"),
    (["3"], ValueError, "whole number"),
    (3, TypeError, "wrap a single key in a list"),
    ("3", TypeError, "iterable of keys"),
])
def test_pin_bad_keys_are_clear_errors(keys, error, match):
    table = SlotTable(2, 4, 4)
    with pytest.raises(error, match=match):
        table.pin(keys)
    assert table.pinned == frozenset()


def test_policies_as_names_specs_or_instances_plan_alike():
    # Research code hands the table a spec or a built instance instead of patching it.
    import random

    from expertcache.policies.registry import admission_spec, eviction_spec, make_admission, make_eviction

    by_name = SlotTable(2, 8, 6, eviction="slru", eviction_params={"protected": 0.5},
                        admission="window", admission_params={"n": 2, "w": 4})
    by_spec = SlotTable(2, 8, 6, eviction=eviction_spec("slru:protected=0.5"),
                        admission=admission_spec("window:n=2:w=4"))
    by_instance = SlotTable(2, 8, 6, eviction=make_eviction("slru", 6, protected=0.5),
                            admission=make_admission("window", n=2, w=4))
    rng = random.Random(2)
    for _ in range(300):
        layer, experts = rng.randrange(2), rng.sample(range(8), rng.randint(1, 3))
        plans = [t.step(layer, experts) for t in (by_name, by_spec, by_instance)]
        assert len({(tuple(p.hits.items()), tuple(p.loads.items()), tuple(p.evictions.items()),
                     tuple(p.bypasses)) for p in plans}) == 1
    assert by_name.stats().to_dict() == by_spec.stats().to_dict() == by_instance.stats().to_dict()
    with pytest.raises(ValueError, match="eviction_params go with a policy name"):
        SlotTable(2, 8, 6, eviction=make_eviction("lru", 6), eviction_params={"x": 1})
    with pytest.raises(ValueError, match="one partition's state"):
        SlotTable(2, 8, 6, eviction=make_eviction("lfru", 3), partition="per-layer")


@pytest.mark.parametrize("admission,slots,partition", [("always", 16, "global"), ("always", 16, "per-layer"),
                                                        ("always", 40, "global"), ("never", 4, "global"),
                                                        ("never", 8, "per-layer")])
def test_a_table_that_never_evicts_plans_as_a_policy_would(admission, slots, partition):
    # Every key fits (admission 'always') or nothing is cached ('never'): the table skips the
    # compiled kernel (no numba loaded) and must plan exactly as a real policy does.
    import random

    from expertcache.policies import registry

    Lru = _python_policy("test-never-evicts-lru", reorder=True)
    try:
        pinned = [] if admission == "never" else [3]
        lean = SlotTable(2, 8, slots, eviction="next-use", admission=admission, partition=partition,
                         pinned=pinned)
        real = SlotTable(2, 8, slots, eviction=Lru.name, admission=admission, partition=partition,
                         pinned=pinned)
        assert lean.kernel is None and lean.eviction_name == "next-use"
        assert lean.seed([0, 9]).loads == real.seed([0, 9]).loads
        rng = random.Random(2)
        for i in range(300):
            layer, experts = rng.randrange(2), rng.sample(range(8), rng.randint(1, 4))
            phase = "prefill" if i % 7 == 0 else "decode"
            a, b = lean.step(layer, experts, phase), real.step(layer, experts, phase)
            assert (a.hits, a.loads, a.evictions, a.bypasses) == (b.hits, b.loads, b.evictions, b.bypasses)
        assert lean.stats().to_dict() == real.stats().to_dict()
        assert lean.stats().total().hits > 0 or admission == "never"
    finally:
        registry._EVICTION.pop(Lru.name)


def test_a_table_that_never_evicts_loads_no_numba():
    # A resident run's table (about 100 MB of numba and LLVM, and their start-up time, for
    # nothing) and a table with a choice to make, which must load the compiled kernel.
    import subprocess
    import sys

    code = ("import sys; from expertcache import SlotTable; "
            "t = SlotTable(4, 8, 32, eviction='next-use'); t.seed(range(32)); t.step(1, [2, 3]); "
            "u = SlotTable(4, 8, 8, admission='never'); u.step(0, [1]); "
            "print('numba' in sys.modules); "
            "v = SlotTable(4, 8, 31, eviction='next-use'); v.step(0, [1]); print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
