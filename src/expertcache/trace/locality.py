"""Routing locality statistics of a trace: what caches feed on.

``lag_reuse``: per layer, the share of a token's experts that the token ``lag``
steps earlier also selected (lag 1 is "consecutive-token reuse"; chance is
top_k / num_experts). ``top_share``: per layer, the share of all selections that
the ``n`` most selected experts carry (popularity skew; uniform is n / E).
"""

from __future__ import annotations

import numpy as np


def _onehot(layer_experts: np.ndarray, num_experts: int) -> np.ndarray:
    """bool [T, E]: which experts each token selected at one layer (ids [T, K])."""
    T = layer_experts.shape[0]
    hot = np.zeros((T, num_experts), dtype=bool)
    hot[np.arange(T)[:, None], layer_experts] = True
    return hot


def lag_reuse(experts: np.ndarray, num_experts: int, lag: int = 1) -> np.ndarray:
    """float [L]: mean over tokens t >= lag of |S_t & S_(t-lag)| / top_k, per layer."""
    L, T, K = experts.shape  # L layers, T tokens, K top-k
    if not isinstance(lag, int) or lag < 1:
        raise ValueError(f"lag must be a positive whole number of tokens, got {lag!r}")
    if T <= lag:
        raise ValueError(f"lag {lag} needs more than {lag} tokens; the trace has {T}")
    out = np.empty(L)
    for layer in range(L):
        hot = _onehot(experts[layer], num_experts)
        out[layer] = (hot[lag:] & hot[:-lag]).sum() / (K * (T - lag))
    return out


def top_share(experts: np.ndarray, num_experts: int, n: int = 8) -> np.ndarray:
    """float [L]: share of a layer's selections carried by its ``n`` most selected experts."""
    L = experts.shape[0]
    counts = np.zeros((L, num_experts), dtype=np.int64)  # L layers, E experts
    for layer in range(L):
        counts[layer] = np.bincount(experts[layer].ravel(), minlength=num_experts)
    top = -np.sort(-counts, axis=1)[:, :n]
    return top.sum(axis=1) / np.maximum(counts.sum(axis=1), 1)


def locality(trace) -> dict[str, np.ndarray]:
    """Per-layer lag-1 reuse and top-8 share of a ``Trace`` (what ``trace info`` prints)."""
    E = trace.num_experts
    stats = {"top8_share": top_share(trace.experts, E, 8)}
    if trace.num_tokens > 1:
        stats["lag1_reuse"] = lag_reuse(trace.experts, E, 1)
    return stats
