"""Synthetic routing traces calibrated to real MoE routing statistics.

The model, per MoE layer (all layers are sampled together, one token at a time):

* popularity: each expert has a log-weight ``skew[l] * z_e`` (``z`` the normal
  quantiles, randomly permuted per layer: skewed but not Zipf, as measured),
  plus a *drift*: a sum of Ornstein-Uhlenbeck processes per expert (``sd``,
  ``tau`` tokens), so the hot set shifts with the topic and recency matters;
* stickiness: each of the previous token's experts is kept with probability
  ``stickiness[l]`` (the short-range reuse real routers show);
* the remaining picks are drawn without replacement in proportion to the
  current popularity (Gumbel top-k), so the layer selects exactly k experts.

Rank order and router weights come from the same Gumbel-perturbed scores:
weights are their softmax over the chosen experts (as top-k routers
renormalise). ``profiles.py`` holds each preset's targets and fitted
parameters; ``research/calibrate_synth.py`` fits the parameters to the targets.
"""

from __future__ import annotations

from functools import lru_cache
from statistics import NormalDist

import numpy as np

from ..presets import ModelShape, preset
from .format import Trace
from .profiles import profile

_CHUNK = 256  # tokens of random numbers drawn per batch (memory vs call overhead)
_DRIFT_EVERY = 8  # the drift (tau >= 50 tokens) is held for this many tokens: 8x fewer draws


def synth_trace(name: str, tokens: int, seed: int = 0, prompt: int = 0) -> Trace:
    """A synthetic trace of the preset ``name`` (one of ``profiles.FITTED``); first ``prompt`` tokens phase 0."""
    shape = preset(name)
    prof = profile(shape.name)
    _check_count("tokens", tokens, 1)
    _check_count("prompt", prompt, 0)
    if prompt > tokens:
        raise ValueError(f"prompt={prompt} exceeds tokens={tokens}; the first 'prompt' tokens are the prompt")
    rng = np.random.default_rng(_check_count("seed", seed, 0))
    experts, weights = sample(shape, prof.skew, prof.stickiness, prof.drift, tokens, rng)
    phase = np.ones(tokens, dtype=np.uint8)
    phase[:prompt] = 0
    meta = {"model": shape.name, "num_experts": shape.experts, "top_k": shape.top_k,
            "n_moe_layers": shape.layers, "expert_bytes": shape.expert_bytes,
            "source": f"expertcache synthetic (preset {shape.name}, seed {seed}; {prof.source})"}
    return Trace(experts, meta, weights, phase)


@lru_cache(maxsize=1)
def _default() -> Trace:
    return synth_trace("qwen3-30b-a3b", 1000, seed=0, prompt=64)


def default_trace() -> Trace:
    """The built-in demo trace: Qwen3-30B-A3B-like, 1000 tokens (64 prompt), seed 0."""
    trace = _default()
    return Trace(trace.experts.copy(), dict(trace.meta), trace.weights.copy(), trace.phase.copy())


def sample(shape: ModelShape, skew, stickiness, drift, tokens: int,
           rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """experts int16 [L, T, K] and weights float16 [L, T, K] from the generator's parameters."""
    L, E, K, T = shape.layers, shape.experts, shape.top_k, tokens
    skew = np.asarray(skew, dtype=float)[:, None]             # [L, 1]
    keep_p = np.asarray(stickiness, dtype=float)[:, None]     # [L, 1]
    quant = np.array([NormalDist().inv_cdf((i + 0.5) / E) for i in range(E)])
    base = np.stack([rng.permutation(quant) for _ in range(L)]) * skew  # [L, E] log-popularity
    damp = np.ones((L, 1))
    damp[0] = 0.0  # layer 0 routes on the token embedding alone: no context, no topic drift
    walks = [(sd, tau, rng.standard_normal((L, E)) * sd) for sd, tau in drift]  # stationary start
    experts = np.empty((L, T, K), dtype=np.int16)
    weights = np.empty((L, T, K), dtype=np.float16)
    rows = np.arange(L)[:, None]
    prev = None
    for start in range(0, T, _CHUNK):
        n = min(_CHUNK, T - start)
        score = base + _gumbel(rng, (n, L, E))             # [n, L, E] Gumbel top-k scores
        coarse = -(-n // _DRIFT_EVERY)                      # drift moves every few tokens
        for j, (sd, tau, last) in enumerate(walks):
            path = _ou_path(last, sd, tau / _DRIFT_EVERY, coarse, rng)  # [coarse, L, E]
            score += np.repeat(path, _DRIFT_EVERY, axis=0)[:n] * damp
            walks[j] = (sd, tau, path[-1])
        keep = rng.random((n, L, K)) < keep_p               # [n, L, K]
        chosen = np.empty((n, L, K), dtype=np.int64)
        for i in range(n):
            pick = score[i].copy()
            if prev is not None:                            # kept experts win a place
                pick[rows, prev] = np.where(keep[i], np.inf, pick[rows, prev])
            prev = np.argpartition(-pick, K - 1, axis=1)[:, :K]
            chosen[i] = prev
        s = np.take_along_axis(score, chosen, 2)            # [n, L, K]
        order = np.argsort(-s, axis=2)                      # router rank order
        chosen = np.take_along_axis(chosen, order, 2)
        s = np.take_along_axis(s, order, 2)
        w = np.exp(s - s[..., :1])
        experts[:, start:start + n] = chosen.transpose(1, 0, 2)
        weights[:, start:start + n] = (w / w.sum(axis=2, keepdims=True)).transpose(1, 0, 2)
    return experts, weights


def _gumbel(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """Standard Gumbel noise in float32 (half the cost of ``rng.gumbel``; ample precision)."""
    u = rng.random(shape, dtype=np.float32)
    return -np.log(-np.log(np.maximum(u, np.float32(1e-12))))


def _ou_path(last: np.ndarray, sd: float, tau: float, n: int,
             rng: np.random.Generator) -> np.ndarray:
    """The next ``n`` values [n, ...] of an Ornstein-Uhlenbeck process with stationary std ``sd``.

    x[i] = rho x[i-1] + e[i], solved in closed form as rho^i (x[-1] + cumsum(rho^-j e[j]))
    so the chunk is a few array operations instead of n Python steps.
    """
    rho = np.exp(-1.0 / tau)
    steps = rng.standard_normal((n, *last.shape), dtype=np.float32) * (sd * np.sqrt(1 - rho * rho))
    i = np.arange(1, n + 1, dtype=float).reshape(-1, *([1] * last.ndim))
    return rho ** i * (last + np.cumsum(steps * rho ** -i, axis=0))


def _check_count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    return int(value)
