"""SlotTable replays of the shared Qwen3 traces match the reference hit rates in
../shared/traces/README.md to the fourth decimal (LRU and Belady, both partitions)."""

from __future__ import annotations

import pytest

from expertcache import SlotTable
from expertcache.policies.belady import Future
from expertcache.trace import load_trace

from conftest import shared_trace

# (trace, partition, policy, slots) -> hit rate, from ../shared/traces/README.md
REFERENCE = {
    ("code", "global", "lru", 768): 0.6297, ("code", "global", "belady", 768): 0.8173,
    ("code", "global", "lru", 1536): 0.8467, ("code", "global", "belady", 1536): 0.9322,
    ("code", "per-layer", "lru", 768): 0.6568, ("code", "per-layer", "belady", 768): 0.7746,
    ("code", "per-layer", "lru", 1536): 0.8448, ("code", "per-layer", "belady", 1536): 0.9182,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REFERENCE), ids=lambda c: "-".join(map(str, c)))
def test_slot_table_matches_reference(case):
    name, partition, policy, slots = case
    trace = load_trace(shared_trace(f"qwen3-30b-a3b-{name}.npz"))
    L, E = trace.num_layers, trace.num_experts
    steps = [(layer, trace.experts[layer, t].tolist())
             for t in range(trace.num_tokens) for layer in range(L)]
    table = SlotTable(L, E, slots, eviction=policy, partition=partition, top_k=trace.top_k)
    if policy == "belady":
        table.bind_future(Future([[layer * E + e for e in ex] for layer, ex in steps]))
    for layer, ex in steps:
        table.step(layer, ex)
    assert round(table.stats().total().hit_rate, 4) == REFERENCE[case]
