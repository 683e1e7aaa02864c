"""Contract suite for EVERY registered policy (the registry is iterated, so new
built-ins and installed plug-ins are covered without touching this file).

Through the SlotTable: capacity never exceeded, a step's keys and pinned keys
never evicted, slot ids unique, inside the partition and stable while resident,
plans consistent with the table, stats add up. On the bare policy: ``victim``
is a pure query that never returns a protected key.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from expertcache import SlotTable
from expertcache.policies.belady import Future
from expertcache.policies.kernels import compiled

from compiled_hooks import Compiled  # tests/ is on sys.path
from expertcache.policies.registry import admission_policies, eviction_policies, make_eviction

EVICTION = sorted(eviction_policies())
ADMISSION = sorted(admission_policies())
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workloads(draw):
    """A small table config and a list of steps (layer, experts in rank order, phase)."""
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(2, 8))
    top_k = draw(st.integers(1, min(4, experts)))
    partition = draw(st.sampled_from(["global", "per-layer"]))
    per = draw(st.integers(top_k, top_k + 4))
    slots = per * (layers if partition == "per-layer" else 1) + draw(st.integers(0, 2))
    n_keys = layers * experts
    pinned = draw(st.lists(st.integers(0, n_keys - 1), max_size=2, unique=True))
    step = st.tuples(st.integers(0, layers - 1),
                     st.lists(st.integers(0, experts - 1), min_size=1, max_size=top_k + 1),
                     st.integers(0, 1))
    steps = draw(st.lists(step, min_size=1, max_size=60))
    return dict(layers=layers, experts=experts, top_k=top_k, partition=partition,
                slots=slots, pinned=pinned, steps=steps)


def _fits_pins(w):
    """Pins must leave each partition room for a full step (plus one) to be a fair test."""
    cap = w["slots"] // (w["layers"] if w["partition"] == "per-layer" else 1)
    per_part = {}
    for key in w["pinned"]:
        part = 0 if w["partition"] == "global" else key // w["experts"]
        per_part[part] = per_part.get(part, 0) + 1
    return all(n + w["top_k"] + 1 <= cap for n in per_part.values())


def _replay_and_check(w, eviction, admission):
    assume(_fits_pins(w))
    try:
        table = SlotTable(w["layers"], w["experts"], w["slots"], eviction=eviction,
                          admission=admission, partition=w["partition"], top_k=w["top_k"],
                          pinned=w["pinned"])
    except ValueError as e:  # oracle, freq need a built-in eviction policy: refused, and said so
        assert admission in ("oracle", "freq") and "plug-in" in str(e)
        assume(False)
    E = w["experts"]
    if table.needs_future:
        table.bind_future(Future([[layer * E + e for e in ex] for layer, ex, _ in w["steps"]]))
    pinned_slots = {k: table.slot_of(k) for k in w["pinned"]}
    cap = table.partition_capacity
    for layer, experts, phase in w["steps"]:
        before = table.resident()
        plan = table.step(layer, experts, phase)
        after = table.resident()
        keys = {layer * E + e for e in experts}
        _check_plan(plan, keys, before, after)
        _check_slots(after, w, cap)
        assert {k: after.get(k) for k in pinned_slots} == pinned_slots, "pinned key moved or left"
    _check_stats(table, w)


def _check_plan(plan, keys, before, after):
    served = set(plan.hits) | set(plan.loads) | set(plan.bypasses)
    assert served == keys and len(plan.hits) + len(plan.loads) + len(plan.bypasses) == len(keys)
    assert not keys & set(plan.evictions), "a key the step needs was evicted"
    for key, slot in plan.hits.items():
        assert before[key] == slot == after[key], "a hit changed its slot"
    for key, slot in plan.evictions.items():
        assert before[key] == slot and key not in after
    freed = set(plan.evictions.values())
    used_before = set(before.values())
    for key, slot in plan.loads.items():
        assert key not in before and after[key] == slot
        assert slot not in used_before or slot in freed, "a load took an occupied slot"
    for key in plan.bypasses:
        assert key not in after
    # Stable: whatever stayed resident kept its slot.
    for key, slot in before.items():
        if key not in plan.evictions:
            assert after[key] == slot, "a resident key moved without being evicted"


def _check_slots(resident, w, cap):
    slots = list(resident.values())
    assert len(slots) == len(set(slots)), "two keys share a slot"
    assert all(0 <= s < w["slots"] for s in slots)
    if w["partition"] == "global":
        assert len(resident) <= cap
        return
    for layer in range(w["layers"]):
        mine = [s for k, s in resident.items() if k // w["experts"] == layer]
        assert len(mine) <= cap
        assert all(layer * cap <= s < (layer + 1) * cap for s in mine), "slot outside its partition"


def _check_stats(table, w):
    total = table.stats().total()
    assert total.accesses == sum(len(set(ex)) for _, ex, _ in w["steps"])
    for phase in (0, 1):
        for layer in range(w["layers"]):
            c = table.stats().layer(layer, phase)
            assert c.accesses == c.hits + c.misses
            assert c.misses == c.loads + c.bypasses
            assert c.evictions <= c.loads


@pytest.mark.parametrize("eviction", EVICTION)
@given(w=workloads())
@SETTINGS
def test_every_eviction_policy_keeps_the_table_contract(eviction, w):
    _replay_and_check(w, eviction, "always")


@pytest.mark.parametrize("admission", ADMISSION)
@given(w=workloads(), eviction=st.sampled_from(EVICTION))
@SETTINGS
def test_every_admission_policy_keeps_the_table_contract(admission, w, eviction):
    _replay_and_check(w, eviction, admission)


def test_every_policy_is_covered_by_name():
    # Guard against a silently empty registry (the suite above would pass vacuously).
    assert {"lru", "fifo", "random", "lfu", "slru", "lfru", "arc", "s3fifo", "static",
            "belady"} <= set(EVICTION)
    assert {"always", "never", "second-hit", "window", "oracle"} <= set(ADMISSION)


# -- the bare policy: victim is a pure query ----------------------------------
ops = st.lists(st.tuples(st.sampled_from(["insert", "access", "evict", "ask"]),
                         st.integers(0, 11), st.sets(st.integers(0, 11), max_size=4)),
               min_size=1, max_size=80)


def _bare(policy):
    """The policy's hooks as the table runs them: compiled for a built-in, else its methods."""
    inner = policy
    while getattr(inner, "inner", None) is not None:
        inner = inner.inner
    return Compiled(policy) if compiled(type(inner)) else policy


@pytest.mark.parametrize("eviction", EVICTION)
@given(capacity=st.integers(1, 6), script=ops)
@SETTINGS
def test_victim_is_pure_and_never_protected(eviction, capacity, script):
    # Built-ins are checked through their compiled hooks (their only definition).
    policy = make_eviction(eviction, capacity)
    if policy.needs_future:
        # Any schedule works for purity: next uses from a fixed pseudo-random sequence.
        policy.bind_future(Future([[k] for k in [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9] * 8]))
    policy = _bare(policy)
    resident: set[int] = set()
    for now, (op, key, protected) in enumerate(script):
        if op == "insert" and key not in resident:
            if len(resident) >= capacity:
                continue
            policy.on_insert(key, now)
            resident.add(key)
        elif op == "access" and key in resident:
            policy.on_access(key, now)
        elif op == "evict":
            v = policy.victim(protected)
            if v is not None:
                policy.on_remove(v)
                resident.discard(v)
        else:
            first = policy.victim(protected)
            policy.victim(set())            # other questions in between ...
            policy.victim(set(resident))
            assert policy.victim(protected) == first, "victim() changed its own answer"
            if first is None:
                assert resident <= protected, "victim() gave up while an unprotected key was resident"
            else:
                assert first in resident and first not in protected
