"""Replay helpers for policy research: steps of a trace through SlotTable, misses vs Belady."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from expertcache import SlotTable
from expertcache.policies.belady import Future
from expertcache.trace import load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def steps_of(name: str, tokens: int | None = None):
    trace = load_trace(TRACES / f"qwen3-30b-a3b-{name}.npz")
    if tokens:
        trace = trace.slice_tokens(tokens)
    L, E = trace.num_layers, trace.num_experts
    ex = trace.experts
    steps = [(layer, ex[layer, t].tolist()) for t in range(trace.num_tokens) for layer in range(L)]
    return steps, L, E, trace.top_k


def replay(steps, L, E, k, slots, partition, eviction, admission="always", ep=None, ap=None):
    table = SlotTable(L, E, slots, eviction=eviction, admission=admission, partition=partition,
                      top_k=k, eviction_params=ep, admission_params=ap)
    if table.needs_future:
        table.bind_future(Future([[layer * E + e for e in ex] for layer, ex in steps]))
    t0 = time.perf_counter()
    for layer, ex in steps:
        table.step(layer, ex)
    c = table.stats().total()
    return c.misses, time.perf_counter() - t0


if __name__ == "__main__":
    name, tokens = sys.argv[1], int(sys.argv[2])
    steps, L, E, k = steps_of(name, tokens)
    for part in ("global", "per-layer"):
        for slots in (768, 1536):
            b, _ = replay(steps, L, E, k, slots, part, "belady")
            m, dt = replay(steps, L, E, k, slots, part, "lru")
            print(part, slots, b, m, round(m / b, 3), f"{dt:.2f}s")
