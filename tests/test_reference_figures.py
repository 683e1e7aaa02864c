"""Replays of the shared Qwen3 traces match the reference hit rates in
../shared/traces/README.md to the fourth decimal (LRU and Belady, both partitions).

The figures go through the simulator's kernels (``sim/replay.py``'s fast path, tested equal to
``SlotTable`` counter for counter in tests/test_sim_fast.py); one small case replays through
the table itself and must equal the kernel there, so the reference also pins the table."""

from __future__ import annotations

import pytest

from expertcache.sim.replay import Prepared, replay
from expertcache.trace import load_trace

from conftest import shared_trace

# (trace, partition, policy, slots) -> hit rate, from ../shared/traces/README.md
REFERENCE = {
    ("code", "global", "lru", 768): 0.6297, ("code", "global", "belady", 768): 0.8173,
    ("code", "global", "lru", 1536): 0.8467, ("code", "global", "belady", 1536): 0.9322,
    ("code", "per-layer", "lru", 768): 0.6568, ("code", "per-layer", "belady", 768): 0.7746,
    ("code", "per-layer", "lru", 1536): 0.8448, ("code", "per-layer", "belady", 1536): 0.9182,
}


@pytest.fixture(scope="module")
def code_trace():
    return load_trace(shared_trace("qwen3-30b-a3b-code.npz"))


@pytest.fixture(scope="module")
def prepared(code_trace):
    return Prepared(code_trace, "token")  # one step per token and layer, as the README's figures


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFERENCE), ids=lambda c: "-".join(map(str, c)))
def test_replay_matches_reference(prepared, case):
    _, partition, policy, slots = case
    result = replay(prepared, policy, slots, partition, engine="fast")
    assert round(result.hit_rate, 4) == REFERENCE[case]


@pytest.mark.slow
@pytest.mark.parametrize("policy, partition", [("lru", "global"), ("belady", "per-layer")])
def test_the_table_equals_the_kernel_on_a_slice(code_trace, policy, partition):
    """The Python SlotTable path on the first 150 tokens: the same counts as the kernel."""
    part = Prepared(code_trace.slice_tokens(150), "token")
    table = replay(part, policy, 768, partition, engine="table")
    fast = replay(part, policy, 768, partition, engine="fast")
    assert table.engine == "table" and fast.engine != "table"
    assert table.stats.total() == fast.stats.total()
