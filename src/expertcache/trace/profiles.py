"""Calibration targets and fitted parameters of the synthetic trace presets.

Targets are per layer: lag-1 reuse and the share of selections carried by the
hottest ``max(1, E // 16)`` experts (top-8 of 128). Qwen3-30B-A3B's are
measured on the shared real traces (mean of code and general, 8000 tokens);
the others are chosen, documented in docs/traces.md. ``skew`` and
``stickiness`` are fitted to the targets by ``research/calibrate_synth.py``;
rerun it and paste its output here after changing a target. ``synth.py`` samples
traces from these profiles (it imports this module, never the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..presets import ModelShape, preset


@dataclass(frozen=True)
class SynthProfile:
    """Calibration targets and fitted generator parameters of one model preset."""

    preset: str
    lag1: tuple[float, ...]        # per layer: target lag-1 reuse
    hot_share: tuple[float, ...]   # per layer: target share of the hottest max(1, E // 16) experts
    skew: tuple[float, ...]        # per layer: std of the static log-popularity (fitted)
    stickiness: tuple[float, ...]  # per layer: P(keep a previous token's expert) (fitted)
    drift: tuple[tuple[float, float], ...]  # (sd, tau tokens) of each OU drift term
    fit_tokens: int                # trace length the targets refer to (top shares fall with length)
    source: str                    # where the targets come from

    def check(self, shape: ModelShape) -> None:
        for name in ("lag1", "hot_share", "skew", "stickiness"):
            if len(getattr(self, name)) != shape.layers:
                raise ValueError(f"synth profile {self.preset!r}: {name} has "
                                 f"{len(getattr(self, name))} values for {shape.layers} layers")


def hot_count(num_experts: int) -> int:
    """How many hottest experts the popularity target counts: 8 of 128, 1 of 8."""
    return max(1, num_experts // 16)


# Measured: per-layer mean of qwen3-30b-a3b-code.npz and -general.npz (expertcache trace info).
QWEN3_LAG1 = (0.13, 0.26, 0.33, 0.38, 0.45, 0.44, 0.53, 0.55, 0.51, 0.51, 0.46, 0.44, 0.48, 0.40,
              0.46, 0.48, 0.45, 0.48, 0.55, 0.58, 0.52, 0.51, 0.45, 0.43, 0.47, 0.41, 0.47, 0.49,
              0.47, 0.49, 0.60, 0.62, 0.56, 0.54, 0.48, 0.46, 0.48, 0.42, 0.48, 0.47, 0.44, 0.45,
              0.43, 0.46, 0.48, 0.48, 0.40, 0.27)
QWEN3_TOP8 = (0.21, 0.23, 0.30, 0.30, 0.36, 0.36, 0.45, 0.45, 0.44, 0.39, 0.32, 0.32, 0.36, 0.28,
              0.38, 0.38, 0.35, 0.44, 0.45, 0.48, 0.45, 0.40, 0.34, 0.34, 0.39, 0.30, 0.39, 0.37,
              0.37, 0.44, 0.48, 0.49, 0.46, 0.42, 0.36, 0.36, 0.39, 0.30, 0.39, 0.35, 0.35, 0.39,
              0.39, 0.38, 0.41, 0.45, 0.40, 0.28)

# Drift: (sd, tau tokens) of a fast and a slow topic drift of log-popularity. Fewer experts need
# less drift: it concentrates the momentary popularity and with it the lag-1 reuse.
DRIFT_SD = {"qwen3-30b-a3b": 0.8, "gpt-oss-120b": 0.8, "gpt-oss-20b": 0.3, "olmoe": 0.3,
            "mixtral-8x7b": 0.15}


def drift(name: str) -> tuple[tuple[float, float], ...]:
    sd = DRIFT_SD[preset(name).name]
    return ((sd, 50.0), (sd, 1000.0))


def resample(values, layers: int) -> tuple[float, ...]:
    """A per-layer profile stretched to ``layers`` layers by relative depth."""
    src = np.linspace(0.0, 1.0, len(values))
    return tuple(round(float(v), 3) for v in np.interp(np.linspace(0.0, 1.0, layers), src, values))


def _mixtral_lag1(layers: int) -> tuple[float, ...]:
    # chance is 2/8 = 0.25; Mixtral's paper reports repeats a little above chance at layer 0 and
    # clearly above it in middle layers: 0.26 at layer 0, 0.36 mid-depth, 0.32 at the last layer
    return resample((0.26, 0.34, 0.36, 0.34, 0.32), layers)


def targets(name: str) -> tuple[tuple[float, ...], tuple[float, ...], str]:
    """(lag1, hot_share, source) for the preset ``name``."""
    shape = preset(name)
    L = shape.layers
    if shape.name == "qwen3-30b-a3b":
        return QWEN3_LAG1, QWEN3_TOP8, "targets measured on the shared Qwen3-30B-A3B traces"
    if shape.name == "mixtral-8x7b":
        return (_mixtral_lag1(L), (0.15,) * L,
                "targets chosen: near-flat popularity (hottest of 8 ~0.15), mild reuse")
    # Qwen3's depth profile stretched to L layers, reuse kept at the same excess over chance
    # (chance = top_k / E); with 64 or fewer experts Qwen3's full skew would force reuse above
    # target even with no stickiness, so those presets take 0.8 of its hot shares
    chance, qwen_chance = shape.top_k / shape.experts, 8 / 128
    lag1 = [chance + (1 - chance) * (r - qwen_chance) / (1 - qwen_chance)
            for r in resample(QWEN3_LAG1, L)]
    scale = 1.0 if shape.experts >= 128 else 0.8
    hot = [h * scale for h in resample(QWEN3_TOP8, L)]
    return (tuple(round(r, 3) for r in lag1), tuple(round(h, 3) for h in hot),
            "targets chosen: the Qwen3 depth profile stretched to this model's layers")


# Fitted by research/calibrate_synth.py (8000 tokens, 8 iterations, seed 0).
FITTED: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    'qwen3-30b-a3b': (
        (0.788, 0.881, 1.475, 1.265, 1.522, 1.583, 1.872, 2.155, 1.933, 1.685, 1.312, 1.566, 1.509,
        1.022, 1.547, 1.575, 1.579, 2.036, 2.239, 2.144, 2.105, 1.683, 1.4, 1.562, 1.666, 1.273,
        1.716, 1.607, 1.64, 2.321, 2.361, 2.37, 2.136, 1.841, 1.572, 1.782, 1.454, 1.169, 1.677,
        1.336, 1.473, 1.761, 1.752, 1.784, 1.93, 2.086, 1.926, 1.091),
        (0.033, 0.066, 0.08, 0.178, 0.213, 0.211, 0.264, 0.296, 0.217, 0.285, 0.282, 0.246, 0.278,
        0.227, 0.242, 0.259, 0.249, 0.168, 0.284, 0.336, 0.227, 0.296, 0.246, 0.213, 0.24, 0.227,
        0.209, 0.281, 0.243, 0.155, 0.365, 0.382, 0.328, 0.326, 0.287, 0.239, 0.26, 0.245, 0.256,
        0.292, 0.21, 0.196, 0.134, 0.202, 0.215, 0.183, 0.047, 0.03)),
    'gpt-oss-120b': (
        (0.752, 0.831, 1.13, 1.45, 1.486, 1.592, 1.526, 1.471, 1.185, 1.38, 1.372, 1.492, 1.486,
        1.89, 1.795, 1.845, 1.35, 1.357, 1.3, 1.241, 1.451, 1.354, 1.586, 1.919, 1.664, 1.655,
        1.434, 1.312, 1.405, 1.328, 1.352, 1.505, 1.332, 1.452, 1.453, 1.074),
        (0.052, 0.154, 0.236, 0.32, 0.332, 0.405, 0.369, 0.372, 0.335, 0.359, 0.313, 0.355, 0.328,
        0.359, 0.455, 0.381, 0.371, 0.305, 0.339, 0.325, 0.373, 0.336, 0.427, 0.486, 0.433, 0.392,
        0.351, 0.355, 0.332, 0.362, 0.325, 0.295, 0.325, 0.319, 0.252, 0.128)),
    'gpt-oss-20b': (
        (0.655, 1.123, 1.376, 1.994, 1.655, 1.079, 1.242, 1.516, 1.456, 1.923, 1.703, 1.181, 1.398,
        1.445, 1.484, 2.261, 1.872, 1.429, 1.028, 1.249, 1.354, 1.522, 1.661, 0.988),
        (0.019, 0.165, 0.265, 0.255, 0.299, 0.343, 0.317, 0.271, 0.272, 0.332, 0.291, 0.303, 0.263,
        0.303, 0.278, 0.347, 0.322, 0.31, 0.315, 0.328, 0.275, 0.252, 0.216, 0.119)),
    'mixtral-8x7b': (
        (0.112, 0.128, 0.19, 0.121, 0.184, 0.132, 0.112, 0.145, 0.109, 0.103, 0.162, 0.087, 0.037,
        0.138, 0.096, 0.175, 0.097, 0.096, 0.062, 0.124, 0.163, 0.183, 0.141, 0.137, 0.135, 0.101,
        0.087, 0.114, 0.07, 0.113, 0.09, 0.108),
        (0.009, 0.016, 0.036, 0.038, 0.072, 0.075, 0.091, 0.111, 0.13, 0.126, 0.124, 0.131, 0.133,
        0.142, 0.137, 0.146, 0.162, 0.158, 0.144, 0.148, 0.14, 0.122, 0.137, 0.131, 0.125, 0.114,
        0.109, 0.105, 0.103, 0.1, 0.091, 0.092)),
    'olmoe': (
        (0.659, 1.093, 1.814, 1.33, 1.142, 1.284, 1.991, 1.255, 1.211, 1.474, 2.114, 1.334, 1.241,
        1.44, 1.548, 0.898),
        (0.02, 0.265, 0.297, 0.342, 0.321, 0.307, 0.327, 0.318, 0.283, 0.295, 0.375, 0.317, 0.312,
        0.251, 0.275, 0.128)),
}


def profile(name: str) -> SynthProfile:
    shape = preset(name)
    if shape.name not in FITTED:
        raise ValueError(f"no synthetic profile for {name!r}; synthetic presets: {', '.join(FITTED)}")
    lag1, hot, source = targets(shape.name)
    skew, stick = FITTED[shape.name]
    prof = SynthProfile(shape.name, lag1, hot, skew, stick, drift(shape.name), 8000, source)
    prof.check(shape)
    return prof
