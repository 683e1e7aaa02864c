"""Synthetic traces: the calibration targets measured on generated traces, seeding, presets."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

from expertcache import SlotTable
from expertcache.presets import PRESETS, preset
from expertcache.trace.locality import lag_reuse, top_share
from expertcache.trace.profiles import FITTED, drift, hot_count, profile, targets
from expertcache.trace.synth import default_trace, synth_trace


@pytest.fixture(scope="module")
def qwen():
    start = time.process_time()
    trace = synth_trace("qwen3-30b-a3b", 8000, seed=7, prompt=100)
    return trace, time.process_time() - start


def lru_hit_rate(trace, fraction, partition="per-layer", tokens=2000):
    L, E = trace.num_layers, trace.num_experts
    table = SlotTable(L, E, int(L * E * fraction), partition=partition, top_k=trace.top_k)
    for token in trace.experts[:, :tokens].transpose(1, 0, 2).tolist():  # token-major replay
        for layer, ids in enumerate(token):
            table.step(layer, ids)
    return table.stats().total().hit_rate


def test_presets_match_published_sizes():
    mb = {name: shape.expert_bytes / 1e6 for name, shape in PRESETS.items()}
    assert mb["qwen3-30b-a3b"] == pytest.approx(9.4, abs=0.05)
    assert mb["gpt-oss-120b"] == pytest.approx(13.2, abs=0.05)
    assert mb["mixtral-8x7b"] == pytest.approx(352, abs=0.5)
    assert mb["olmoe"] == pytest.approx(12.6, abs=0.05)
    gpt = preset("GPT-OSS-120B")  # case-insensitive
    assert gpt.layers * gpt.top_k * gpt.expert_bytes / 2**30 == pytest.approx(1.8, abs=0.05)


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match="unknown model preset 'llama'; known presets: qwen3-30b-a3b, "):
        preset("llama")
    with pytest.raises(TypeError, match="preset name must be a string"):
        preset(3)


def test_qwen3_hits_measured_targets(qwen):
    trace, _ = qwen
    lag1_t, hot_t, _ = targets("qwen3-30b-a3b")
    r, h = lag_reuse(trace.experts, 128), top_share(trace.experts, 128, 8)
    assert abs(r.mean() - np.mean(lag1_t)) < 0.02 and abs(h.mean() - np.mean(hot_t)) < 0.02
    # per layer, seed to seed: slow drift over 8000 tokens moves a top-8 share by up to ~0.12
    assert np.abs(r - lag1_t).max() < 0.08 and np.abs(h - hot_t).max() < 0.14
    assert np.corrcoef(r, lag1_t)[0, 1] > 0.9  # the depth profile, not only the mean
    assert r[0] < 0.2 and r[0] < r[len(r) // 2 :].mean() - 0.2  # layer 0 near random
    assert 0.40 <= r.mean() <= 0.50 and 0.32 <= h.mean() <= 0.43  # the range real Qwen3-30B-A3B routing shows


def test_qwen3_lru_hit_rates_like_real_traces(qwen):
    # real traces, first 2000 tokens, per-layer LRU: code 0.658 / 0.839, general 0.601 / 0.780
    trace, _ = qwen
    assert 0.57 <= lru_hit_rate(trace, 0.125) <= 0.69
    assert 0.75 <= lru_hit_rate(trace, 0.25) <= 0.87


def test_generation_is_fast_enough(qwen):
    _, cpu_seconds = qwen
    assert cpu_seconds < 5.0, f"8000 tokens x 48 layers took {cpu_seconds:.1f} s of CPU"


def test_mixtral_nearly_flat():
    trace = synth_trace("mixtral-8x7b", 4000, seed=1)
    hottest = top_share(trace.experts, 8, 1)
    assert abs(hottest.mean() - 0.15) < 0.02 and hottest.max() < 0.21  # uniform would be 0.125
    lag1_t = targets("mixtral-8x7b")[0]
    assert abs(lag_reuse(trace.experts, 8).mean() - np.mean(lag1_t)) < 0.03


@pytest.mark.parametrize("name", sorted(FITTED))
def test_every_preset_generates_its_shape(name):
    shape = preset(name)
    trace = synth_trace(name, 300, seed=2, prompt=10)
    assert trace.experts.shape == (shape.layers, 300, shape.top_k)
    assert trace.weights.shape == trace.experts.shape and trace.weights.dtype == np.float16
    assert trace.meta["expert_bytes"] == shape.expert_bytes and trace.num_experts == shape.experts
    sorted_ids = np.sort(trace.experts, axis=2)
    assert (np.diff(sorted_ids, axis=2) > 0).all()  # k distinct experts per token and layer
    w = trace.weights.astype(np.float32)
    assert np.allclose(w.sum(axis=2), 1, atol=1e-2) and (np.diff(w, axis=2) <= 1e-3).all()
    assert trace.phase[:10].tolist() == [0] * 10 and (trace.phase[10:] == 1).all()
    assert profile(name).drift == drift(name)


def test_seeding_is_deterministic():
    a = synth_trace("olmoe", 500, seed=11)
    b = synth_trace("olmoe", 500, seed=11)
    c = synth_trace("olmoe", 500, seed=12)
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.weights, b.weights)
    assert not np.array_equal(a.experts, c.experts)


def test_fit_reaches_targets_on_a_small_model():
    """The research script that produced profiles.FITTED still fits (it is not in the package)."""
    fit = _research("calibrate_synth").fit
    shape = preset("olmoe")
    lag1_t, hot_t, _ = targets("olmoe")
    skew, stick = fit(shape, lag1_t, hot_t, drift("olmoe"), tokens=3000, iters=6)
    from expertcache.trace.synth import sample
    ex, _ = sample(shape, skew, stick, drift("olmoe"), 3000, np.random.default_rng(5))
    assert np.abs(lag_reuse(ex, 64) - lag1_t).max() < 0.06
    assert np.abs(top_share(ex, 64, hot_count(64)) - hot_t).max() < 0.07


def test_default_trace_is_small_fixed_and_a_copy():
    a = default_trace()
    assert a.experts.shape == (48, 1000, 8) and int((a.phases == 0).sum()) == 64
    a.experts[:] = 0
    assert default_trace().experts.any()


@pytest.mark.parametrize("kwargs,message", [
    ({"tokens": 0}, "tokens must be a whole number >= 1"),
    ({"tokens": 5, "prompt": 6}, "prompt=6 exceeds tokens=5"),
    ({"tokens": 5, "seed": -1}, "seed must be a whole number >= 0"),
    ({"tokens": 2.5}, "tokens must be a whole number"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synth_trace("olmoe", **kwargs)


def _research(name: str):
    """A module of research/ (scripts, not a package), loaded from its file."""
    path = Path(__file__).resolve().parents[1] / "research" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"research_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
