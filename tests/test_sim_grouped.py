"""Traces whose steps are an engine's batches (meta ``prefill_steps: grouped``, ``step_tokens``):
replays plan each step as the union of its tokens' experts, like the live engine did."""

from __future__ import annotations

import numpy as np
import pytest

from expertcache.cache import SlotTable
from expertcache.sim.replay import replay
from expertcache.stats import DECODE, PREFILL
from expertcache.trace.format import Trace
from expertcache.trace.steps import step_rows


def grouped_trace(steps=(5, 2, 2, 3, 1, 2), L=3, E=12, K=2, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    T = sum(steps)
    ex = np.stack([[rng.choice(E, K, replace=False) for _ in range(T)] for _ in range(L)]).astype(np.int16)
    phase = np.repeat(np.array([0, 1, 1, 0, 1, 1], np.uint8)[:len(steps)], steps)
    meta = {"num_experts": E, "top_k": K, "n_moe_layers": L, "prefill_steps": "grouped",
            "step_tokens": list(steps)}
    return Trace(ex, meta, phase=phase)


def live_counts(trace: Trace, slots: int, partition: str):
    """What the engine did: one SlotTable step per engine step and layer."""
    table = SlotTable(trace.num_layers, trace.num_experts, slots, eviction="lru", partition=partition,
                      top_k=trace.top_k)
    start = 0
    for n in trace.meta["step_tokens"]:
        phase = PREFILL if (trace.phases[start:start + n] == 0).any() else DECODE
        for layer in range(trace.num_layers):
            union = list(dict.fromkeys(trace.experts[layer, start:start + n].reshape(-1).tolist()))
            table.step(layer, union, phase)
        start += n
    return table.stats()


@pytest.mark.parametrize("slots, partition", [(6, "global"), (12, "per-layer"), (4, "global")])
def test_replay_equals_the_engine_steps(slots, partition):
    trace = grouped_trace()
    want = live_counts(trace, slots, partition)
    for engine in ("table", "auto"):
        got = replay(trace, "lru", slots, partition, engine=engine).stats
        for phase in ("prefill", "decode"):
            assert got.total(phase) == want.total(phase), (engine, phase)


def test_rows_are_unions_and_a_prompt_token_makes_a_prefill_step():
    trace = grouped_trace()
    rows, phases = step_rows(trace)
    assert len(rows) == 6 and phases == [PREFILL, DECODE, DECODE, PREFILL, DECODE, DECODE]
    assert rows[0][1] == list(dict.fromkeys(trace.experts[1, :5].reshape(-1).tolist()))


@pytest.mark.parametrize("sizes, words", [([5, 2], "adds up to 7 tokens but the trace has 15"),
                                          ([0, 15], "list of positive token counts"),
                                          (None, "needs meta 'step_tokens'")])
def test_bad_step_tokens(sizes, words):
    trace = grouped_trace()
    trace.meta["step_tokens"] = sizes
    with pytest.raises(ValueError, match=words):
        step_rows(trace)
