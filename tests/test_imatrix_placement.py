"""Coverage, placement plans and pinning/seeding a SlotTable from expert counts."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache import SlotTable
from expertcache.imatrix import (ExpertCounts, apply_imatrix, coverage, place, placement_keys,
                                 plan_coverage, plan_keys, table_plan)
from expertcache.trace import Trace


# -- coverage -------------------------------------------------------------------------
def test_coverage_by_hand():
    rows = coverage(np.array([[50, 30, 20, 0], [0, 0, 0, 0], [25, 25, 25, 25]]), hot=2)
    assert rows[0] == {"layer": 0, "routed": 100, "top1_share": 0.5, "experts_for_50": 1,
                       "experts_for_90": 3, "unused": 1, "hot": [0, 1]}
    assert rows[1]["experts_for_50"] is None and rows[1]["hot"] == [] and rows[1]["top1_share"] == 0.0
    # flat layer: exactly 2 of 4 reach 50% (no float slack pushes it to 3), 4 for 90%
    assert (rows[2]["experts_for_50"], rows[2]["experts_for_90"]) == (2, 4)


# -- placement ------------------------------------------------------------------------
def test_concentrated_layers_get_more_slots():
    counts = np.array([[90, 5, 5, 0], [25, 25, 25, 25]])
    assert placement_keys(counts, 3, top_k=1) == [(0, 0), (1, 0), (1, 1)]
    # zero-count experts are never placed, so a big budget stops short
    assert len(placement_keys(counts, 100)) == 7


def test_shares_not_raw_counts_decide():
    # layer 1 saw far fewer tokens, but its expert 0 takes 90% of them
    counts = np.array([[600, 400], [9, 1]])
    assert placement_keys(counts, 1) == [(1, 0)]


def test_max_per_layer_caps_each_layer():
    counts = np.array([[90, 80, 70, 60], [1, 1, 1, 1]])
    plan = placement_keys(counts, 4, max_per_layer=2)
    assert plan == [(0, 0), (0, 1), (1, 0), (1, 1)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 20), min_size=3, max_size=3), min_size=1, max_size=3),
       st.integers(0, 9))
def test_plan_maximises_static_coverage(rows, budget):
    """Greedy by share equals the best of all subsets of the same size (brute force)."""
    counts = np.array(rows)
    plan = placement_keys(counts, budget)
    got = plan_coverage(counts, plan)["mean_share"]
    shares = ExpertCounts(counts).shares().ravel()
    best = max((shares[list(c)].sum() for c in itertools.combinations(range(shares.size),
                                                                     min(budget, shares.size))),
               default=0.0) / counts.shape[0]
    assert got == pytest.approx(best, abs=1e-5)
    assert len(set(plan)) == len(plan)


def test_bad_placement_inputs():
    with pytest.raises(ValueError, match="slots must be"):
        placement_keys(np.ones((2, 4)), -1)
    with pytest.raises(ValueError, match="top_k=5 exceeds the 4 experts"):
        placement_keys(np.ones((2, 4)), 2, top_k=5)
    with pytest.raises(ValueError, match="NaN"):
        placement_keys(np.array([[1.0, np.nan]]), 1)


# -- pin and seed in a SlotTable --------------------------------------------------------
HOT = np.array([[100, 50, 1, 1, 0, 0], [0, 0, 70, 1, 1, 60]])  # 2 layers x 6 experts


def test_pin_keeps_plan_resident_through_a_flood():
    table = SlotTable(2, 6, 6, top_k=2)
    plan = table_plan(ExpertCounts(HOT), table, "pin")          # default: half of 6 slots
    assert plan == [(0, 0), (1, 2), (1, 5)]
    loads = apply_imatrix(table, plan, "pin").loads
    assert sorted(loads) == [0, 8, 11] and len(set(loads.values())) == 3
    for _ in range(20):                                          # every other expert, over and over
        for layer in (0, 1):
            table.step(layer, [1, 3])
            table.step(layer, [4, 2 if layer == 0 else 0])
    assert {0, 8, 11} <= set(table.resident())
    assert table.pinned == frozenset({0, 8, 11})
    table.step(0, [0])
    assert table.stats().layer(0).hits >= 1


def test_seed_is_evictable():
    table = SlotTable(2, 6, 4, top_k=2)
    plan = table_plan(ExpertCounts(HOT), table, "seed")          # default: the whole cache
    assert len(plan) == 4
    assert sorted(apply_imatrix(table, plan, "seed").loads) == [0, 1, 8, 11]
    table.step(0, [0])
    assert table.stats().total().hits == 1                       # warm start: a hit at once
    for e in (2, 3, 4, 5):
        table.step(0, [e])
    assert 0 not in table.resident() and not table.pinned


def test_per_layer_partition_caps_each_layer():
    table = SlotTable(2, 6, 8, top_k=2, partition="per-layer")  # 4 slots per layer
    plan = table_plan(ExpertCounts(HOT), table, "pin")           # half of each: 2 per layer
    assert sorted(plan) == [(0, 0), (0, 1), (1, 2), (1, 5)]
    with pytest.raises(ValueError, match=r"each layer's 4 slots and leave top_k=2"):
        table_plan(ExpertCounts(HOT), table, "pin", budget=6)


def test_pin_must_leave_top_k_dynamic_slots():
    table = SlotTable(2, 6, 6, top_k=2)
    with pytest.raises(ValueError, match="does not fit the pool's 6 free slots and leave top_k=2 for the step; use at most 4"):
        table_plan(ExpertCounts(HOT), table, "pin", budget=5)
    with pytest.raises(ValueError, match="leaves 1 for everything else, fewer than top_k=2"):
        apply_imatrix(table, [(0, 0), (0, 1), (1, 2), (1, 5), (0, 2)], "pin")
    assert not table.resident()                                  # nothing half-applied


def test_pin_needs_a_fresh_table_and_matching_shape():
    table = SlotTable(2, 6, 6, top_k=2)
    table.step(0, [3])
    with pytest.raises(ValueError, match="fresh cache"):
        apply_imatrix(table, [(0, 0)], "pin")
    with pytest.raises(ValueError, match="counts are for 2 layers x 4 experts but the cache is for 2 x 6"):
        table_plan(ExpertCounts(np.ones((2, 4))), table, "seed")
    with pytest.raises(ValueError, match="unknown imatrix mode 'hot'"):
        apply_imatrix(table, [], "hot")


def test_place_from_a_file(tmp_path):
    path = tmp_path / "counts.npy"
    np.save(path, HOT)
    table = SlotTable(2, 6, 6, top_k=2)
    assert sorted(place(table, path, "pin").loads) == [0, 8, 11]
    assert not place(SlotTable(2, 6, 6, top_k=2), path, "none").loads


# -- the study's replay helper on a synthetic trace ---------------------------------------
def _study():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "imatrix_study.py"
    spec = importlib.util.spec_from_file_location("imatrix_study", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pinning_helps_when_a_scan_floods_a_recency_cache():
    """Each token uses one of 4 hot experts and a never-repeating cold one: LRU loses
    the hot ones to the scan, a pinned hot set keeps them."""
    rng = np.random.default_rng(0)
    T, E = 400, 404
    hot = rng.integers(0, 4, T)
    cold = 4 + np.arange(T)
    experts = np.stack([hot, cold], axis=1)[None].astype(np.int16)   # [1, T, 2]
    trace = Trace(experts, {"num_experts": E, "top_k": 2, "n_moe_layers": 1})
    counts = ExpertCounts(np.bincount(hot, minlength=E)[None])
    study = _study()
    none = study.replay(trace, 6, "global")["hit_rate"]
    pinned = study.replay(trace, 6, "global", "pin", counts, 4 / 6)
    assert pinned["placed"] == 4 and pinned["hit_rate"] > none + 0.15


def test_plan_keys_for_code_that_builds_its_own_table():
    keys = plan_keys(ExpertCounts(HOT), num_layers=2, num_experts=6, slots=6, top_k=2, mode="pin")
    assert keys == [0, 8, 11]
    table = SlotTable(2, 6, 6, top_k=2, pinned=keys)        # what sim.replay(pinned=...) does
    assert table.pinned == frozenset(keys)
    seeds = plan_keys(ExpertCounts(HOT), num_layers=2, num_experts=6, slots=8, top_k=2,
                      partition="per-layer", mode="seed")
    # 4 slots per layer: each layer's 4 experts with non-zero counts
    assert sorted(seeds) == [0, 1, 2, 3, 8, 9, 10, 11]
