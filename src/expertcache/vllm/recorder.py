"""The routing of counted steps as the project's trace (.npz), replayable by ``expertcache sim``.

Each counted forward pass is one *step* of ``n`` real tokens; every MoE layer plans the
union of those tokens' experts. The trace keeps the tokens in step order
(``experts [L, T, k]``) and says how they group: meta ``prefill_steps: "grouped"`` and
``step_tokens`` (tokens per step). ``phase`` per token is its step's phase (a step
with any prompt token is a prefill step). A replay in that order is the live plan, so
``sim`` gives the live hits and misses (tests/vllm asserts it).
"""

from __future__ import annotations

import numpy as np

from ..trace.format import Trace, save_trace


class Recorder:
    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.L, self.E, self.k = num_layers, num_experts, top_k
        self.rows: list[list[np.ndarray]] = [[] for _ in range(num_layers)]  # per layer: [n, k] per step
        self.step_tokens: list[int] = []
        self.phases: list[int] = []

    def add(self, layer: int, rows: list[list[int]], phase: int) -> None:
        self.rows[layer].append(np.asarray(rows, dtype=np.int16).reshape(len(rows), self.k))
        if layer == 0:
            self.step_tokens.append(len(rows))
            self.phases.append(phase)

    def trace(self, session) -> Trace:
        done = min(len(r) for r in self.rows)  # whole forward passes only
        steps = self.step_tokens[:done]
        experts = np.stack([np.concatenate(r[:done]) if done else np.zeros((0, self.k), np.int16)
                            for r in self.rows])                           # [L, T, k]
        phase = np.repeat(np.asarray(self.phases[:done], np.uint8), steps)  # [T]
        host = session.hosts[0]
        meta = {"model": str(session.vllm_config.model_config.model), "num_experts": self.E,
                "top_k": self.k, "n_moe_layers": self.L, "prefill_steps": "grouped",
                "step_tokens": [int(n) for n in steps], "source": "expertcache vllm plug-in"}
        if host is not None:
            meta["expert_bytes"] = int(host.expert_bytes)
        return Trace(experts, meta, phase=phase)

    def save(self, path: str, session) -> None:
        save_trace(self.trace(session), path)
