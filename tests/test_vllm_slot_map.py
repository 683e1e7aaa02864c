"""The vLLM step's persistent expert -> slot map gives, for every expert of a step, the slot
that step's mapping names, however earlier steps left it (runs without vLLM)."""

from __future__ import annotations

import random

import torch

from expertcache.vllm.step import SlotMap


def test_slot_map_follows_each_steps_mapping():
    rng = random.Random(0)
    L, E, K, slots = 3, 16, 4, 10
    smap = SlotMap(L, E, "cpu")
    for _ in range(300):
        layer, tokens = rng.randrange(L), rng.randrange(1, 5)
        topk = torch.tensor([rng.sample(range(E), K) for _ in range(tokens)], dtype=torch.int32)
        experts = sorted(set(topk.flatten().tolist()))
        mapping = dict(zip(experts, rng.sample(range(slots), min(len(experts), slots))))
        if len(mapping) < len(experts):
            continue  # more experts than slots: that step runs in rounds, not through the map
        ids = smap.ids(layer, mapping, topk)
        assert ids.dtype == torch.int32 and ids.shape == topk.shape
        assert ids.tolist() == [[mapping[e] for e in row] for row in topk.tolist()]


def test_slot_map_all_hit_step_writes_nothing():
    smap = SlotMap(2, 8, "cpu")
    topk = torch.tensor([[1, 2]], dtype=torch.int32)
    smap.ids(0, {1: 5, 2: 6}, topk)
    before = smap.table.clone()
    assert smap.ids(0, {1: 5, 2: 6}, topk).tolist() == [[5, 6]]
    assert torch.equal(smap.table, before) and smap.table[1].tolist() == [0] * 8  # other layer untouched
