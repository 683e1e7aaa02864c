"""The batch-aware ``default`` (next-use with ``freq`` admission): the live table and the
simulator agree on grouped traces, one token's steps behave as plain next-use, and batched
steps bypass misses that would flush hotter keys."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.cache import SlotTable
from expertcache.sim.replay import replay
from expertcache.trace.batch import batch_traces
from expertcache.trace.format import Trace
from expertcache.trace.steps import step_rows


def skewed(T=600, L=3, E=32, K=4, seed=0) -> Trace:
    """Zipf-like routing: a few hot experts per layer, a long tail."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, E + 1) ** 1.1
    p /= p.sum()
    ex = np.stack([[rng.choice(E, K, replace=False, p=p) for _ in range(T)] for _ in range(L)])
    return Trace(ex.astype(np.int16), {"num_experts": E, "top_k": K, "n_moe_layers": L})


def same(a, b) -> bool:
    """Equal counts, layer by layer and phase by phase."""
    return all(a.layer(l, ph) == b.layer(l, ph) for l in range(3) for ph in (0, 1))


def live(trace: Trace, policy: str, slots: int, partition: str):
    eviction, _, admission = policy.partition("+")
    table = SlotTable(trace.num_layers, trace.num_experts, slots, eviction=eviction,
                      admission=admission or None, partition=partition, top_k=trace.top_k)
    rows, phases = step_rows(trace)
    for row, phase in zip(rows, phases):
        for layer, experts in enumerate(row):
            table.step(layer, experts, phase)
    return table.stats()


@pytest.mark.parametrize("requests, slots, partition", [(4, 24, "global"), (8, 24, "per-layer"),
                                                        (4, 48, "global")])
def test_live_table_equals_sim_on_a_grouped_trace(requests, slots, partition):
    trace = batch_traces([skewed()], requests)
    got = replay(trace, "default", slots, partition)
    assert got.label == "default (next-use+freq)"
    assert same(got.stats, live(trace, "default", slots, partition))
    plain = replay(trace, "next-use", slots, partition)
    assert got.total.bypasses > plain.total.bypasses  # freq really decided something


def test_one_token_steps_are_plain_next_use():
    trace = skewed()
    for partition, slots in (("global", 24), ("per-layer", 24)):
        assert same(replay(trace, "default", slots, partition).stats,
                    replay(trace, "next-use", slots, partition).stats)


def test_batched_default_beats_plain_next_use_and_random():
    # A batch needs more keys per pass than fit: admitting every miss flushes the hot set.
    trace = batch_traces([skewed(T=1200)], 8)
    hits = {p: replay(trace, p, 24, "global").hit_rate for p in ("default", "next-use", "random")}
    assert hits["default"] > hits["next-use"] and hits["default"] > hits["random"], hits


def test_explicit_admission_wins_over_the_default_s_own():
    trace = batch_traces([skewed()], 4)
    assert same(replay(trace, "default+second-hit", 24, "global").stats,
                replay(trace, "next-use+second-hit", 24, "global").stats)


def test_freq_with_a_plug_in_eviction_is_refused():
    with pytest.raises(ValueError, match="'freq' weighs the key against the victim"):
        SlotTable(2, 8, 4, eviction="lfru", admission="freq")
