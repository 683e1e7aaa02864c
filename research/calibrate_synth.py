"""Fit the synthetic trace generator to each preset's targets; print the FITTED table.

    .venv/bin/python research/calibrate_synth.py [PRESET ...]

Prints ``trace/profiles.py``'s FITTED entries (paste them there), then checks the
fit on a fresh seed: per-layer lag-1 reuse and hot share against the targets
and LRU hit rates at 12.5 % / 25 % of experts through SlotTable. Research, not
library: ``fit`` lives here with its only user; the package keeps the numbers.
"""

from __future__ import annotations

import sys
import textwrap
import time

import numpy as np

from expertcache import SlotTable
from expertcache.presets import ModelShape, preset
from expertcache.trace import profiles
from expertcache.trace.locality import lag_reuse, top_share
from expertcache.trace.profiles import hot_count
from expertcache.trace.synth import sample


def fit(shape: ModelShape, lag1, hot_share, drift, tokens: int = 8000, iters: int = 8,
        seed: int = 0) -> tuple[list[float], list[float]]:
    """Per-layer (skew, stickiness) whose traces hit the ``lag1`` and ``hot_share`` targets.

    A damped fixed-point iteration on full-length pilot traces: skew moves with
    the popularity error, stickiness with the reuse error. Offline only: its
    output is pasted into ``profiles.FITTED``.
    """
    r_target, h_target = np.asarray(lag1, float), np.asarray(hot_share, float)
    skew, stick = np.full(shape.layers, 1.5), np.full(shape.layers, 0.1)
    n_hot = hot_count(shape.experts)
    for _ in range(iters):
        ex, _ = sample(shape, skew, stick, drift, tokens, np.random.default_rng(seed))
        r, h = lag_reuse(ex, shape.experts, 1), top_share(ex, shape.experts, n_hot)
        skew = np.clip(skew + 4.0 * (h_target - h), 0.0, 4.0)
        stick = np.clip(stick + 1.2 * (r_target - r), 0.0, 0.95)
    return [round(float(v), 3) for v in skew], [round(float(v), 3) for v in stick]


def lru_hit_rate(experts: np.ndarray, num_experts: int, slots: int, partition: str) -> float:
    L, T, K = experts.shape
    table = SlotTable(L, num_experts, slots, partition=partition, top_k=K)
    rows = experts.transpose(1, 0, 2).tolist()  # token-major, as the simulator replays
    for token in rows:
        for layer, ids in enumerate(token):
            table.step(layer, ids)
    return table.stats().total().hit_rate


def _wrap(values: list[float]) -> str:
    """A tuple literal wrapped at 100 columns, indented for profiles.FITTED."""
    text = textwrap.fill(", ".join(str(v) for v in values), 90, break_on_hyphens=False)
    return textwrap.indent("(" + text + ")", " " * 8)


def main(names: list[str]) -> None:
    for name in names or ["qwen3-30b-a3b", "gpt-oss-120b", "gpt-oss-20b", "mixtral-8x7b", "olmoe"]:
        shape = preset(name)
        lag1, hot, _ = profiles.targets(name)
        t0 = time.perf_counter()
        skew, stick = fit(shape, lag1, hot, profiles.drift(name))
        print(f"    {name!r}: (\n{_wrap(skew)},\n{_wrap(stick)}),")
        ex, _ = sample(shape, skew, stick, profiles.drift(name), 8000, np.random.default_rng(1))
        r, h = lag_reuse(ex, shape.experts), top_share(ex, shape.experts, hot_count(shape.experts))
        print(f"# {name}: fit {time.perf_counter() - t0:.0f} s; seed 1: lag1 mean {r.mean():.3f} "
              f"(target {np.mean(lag1):.3f}, max layer error {np.abs(r - lag1).max():.3f}); "
              f"hot share mean {h.mean():.3f} (target {np.mean(hot):.3f}, "
              f"max error {np.abs(h - hot).max():.3f})")
        total = shape.layers * shape.experts
        for frac in (0.125, 0.25):
            slots = max(int(total * frac), shape.top_k * shape.layers)
            rates = [lru_hit_rate(ex[:, :2000], shape.experts, slots, p) for p in ("per-layer", "global")]
            print(f"#   LRU at {frac:.1%} ({slots} slots, first 2000 tokens): "
                  f"per-layer {rates[0]:.4f}, global {rates[1]:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
