"""The test oracle for live replay: a recorded trace stepped through a ``SlotTable`` in the
order the runtime planned the live run, written as plainly as possible.

The runtime plans a prompt as ONE step per layer (the union of the prompt's experts,
token-major, rank order) and each generated token as one step per layer. The simulator
gets that order from ``trace.steps.step_rows`` (fast, array-shaped); this is the same
order spelled out step by step, so tests can hold both the simulator and a live run
against it. Recorded traces say so in their meta (``"prefill_steps": "batched"``).
"""

from __future__ import annotations

import numpy as np

from expertcache import SlotTable
from expertcache.stats import PREFILL, Stats
from expertcache.trace import Trace


def live_steps(trace: Trace):
    """Yield ``(layer, experts, phase)``: the leading prompt tokens as one step per layer,
    then one step per token per layer."""
    phases = trace.phases
    prompt = int(np.argmax(phases != PREFILL)) if (phases != PREFILL).any() else len(phases)
    rows = trace.experts.tolist()  # [L][T][K]
    if prompt:
        for layer in range(trace.num_layers):
            yield layer, list(dict.fromkeys(e for tok in rows[layer][:prompt] for e in tok)), PREFILL
    for t in range(prompt, trace.num_tokens):
        for layer in range(trace.num_layers):
            yield layer, rows[layer][t], int(phases[t])


def replay_live(trace: Trace, table: SlotTable) -> Stats:
    """Step ``table`` through ``live_steps(trace)``; its stats equal the live run's."""
    for layer, experts, phase in live_steps(trace):
        table.step(layer, experts, phase)
    return table.stats()
