"""Cost model arithmetic by hand, miss-path choice, hardware presets, profiles and probe."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertcache.costmodel import (ExpertCost, Hardware, bytes_moved, chosen_path, miss_times,
                                   token_time, tokens_per_second)
from expertcache.costmodel.hardware import PRESETS, cpu_mem_gbps, load_hardware, probe, save_profile
from expertcache.sim.report import expert_cost
from expertcache.trace import Trace

# Round numbers so every term can be checked by hand.
HW = Hardware("test", h2d_gbps=10, gpu_mem_gbps=1000, cpu_mem_gbps=50, cpu_gflops=100,
              transfer_latency_s=1e-5, layer_overhead_s=2e-5)
MODEL = ExpertCost(expert_bytes=10_000_000, expert_flops=2e9, dense_bytes=1_000_000_000)


def test_expert_times_by_hand():
    t = miss_times(MODEL, HW)
    assert t["hit"] == pytest.approx(1e7 / 1e12)                 # 10 us from GPU memory
    assert t["fetch"] == pytest.approx(1e-5 + 1e7 / 1e10 + 1e-5)  # latency + 1 ms + compute
    assert t["cpu"] == pytest.approx(max(1e7 / 5e10, 2e9 / 1e11))  # 20 ms, compute bound


def test_token_time_by_hand():
    # 3 layers, 10 hits and 2 misses per token; misses fetched (1.02 ms < 20 ms on CPU).
    expected = 1e9 / 1e12 + 3 * 2e-5 + 10 * 1e-5 + 2 * (1e-5 + 1e-3 + 1e-5)
    assert token_time(10, 2, MODEL, HW, layers=3) == pytest.approx(expected)
    assert token_time(10, 2, MODEL, HW, layers=3, miss_path="cpu") == pytest.approx(
        1e-3 + 6e-5 + 1e-4 + 2 * 0.02)
    assert tokens_per_second(10, 2, MODEL, HW, layers=3) == pytest.approx(1 / expected)


def test_auto_takes_the_cheaper_path_per_expert():
    assert chosen_path(MODEL, HW) == "fetch"
    slow_bus = Hardware("slow-bus", h2d_gbps=0.1, gpu_mem_gbps=1000, cpu_mem_gbps=50, cpu_gflops=1e4)
    assert chosen_path(MODEL, slow_bus) == "cpu"
    t = token_time(0, 1, MODEL, slow_bus)
    assert t == pytest.approx(1e-3 + miss_times(MODEL, slow_bus)["cpu"])
    # More hits never make a token slower; more misses always do.
    assert token_time(5, 1, MODEL, HW) < token_time(5, 2, MODEL, HW)


def test_bytes_moved():
    assert bytes_moved(7, 5, 100, "fetch") == 700
    assert bytes_moved(7, 5, 100, "cpu") == 500
    assert bytes_moved(7, 5, None) is None


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match="h2d_gbps must be a positive number"):
        Hardware("x", h2d_gbps=0, gpu_mem_gbps=1, cpu_mem_gbps=1, cpu_gflops=1)
    with pytest.raises(ValueError, match="expert_bytes"):
        ExpertCost(0)
    with pytest.raises(ValueError, match="miss path"):
        token_time(1, 1, MODEL, HW, miss_path="disk")


def test_presets_and_profile_round_trip(tmp_path):
    assert {"pcie4-consumer", "pcie5-consumer", "h200"} <= set(PRESETS)
    assert PRESETS["pcie5-consumer"].h2d_gbps == 2 * PRESETS["pcie4-consumer"].h2d_gbps
    path = save_profile(HW, tmp_path / "hw.json", {"measured": []})
    assert load_hardware(path) == HW
    with pytest.raises(ValueError, match="unknown hardware 'laptop'.*pcie4-consumer"):
        load_hardware("laptop")
    with pytest.raises(FileNotFoundError):
        load_hardware(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="needs at least h2d_gbps"):
        load_hardware(tmp_path / "bad.json")


def test_probe_measures_the_cpu_and_keeps_unmeasured_fields():
    hw, report = probe("h200", seconds=0.05)
    assert {"cpu_gflops", "cpu_mem_gbps"} <= set(report["measured"])
    assert hw.cpu_gflops > 0.1 and hw.cpu_mem_gbps > 0.1
    if "h2d_gbps" not in report["measured"]:  # no CUDA here: taken from the base preset
        assert hw.h2d_gbps == PRESETS["h200"].h2d_gbps
    assert 0.1 < cpu_mem_gbps(0.02, mib=16) < 10_000
    from expertcache.quant import ggml

    assert ("cpu_quant_gflops" in report["measured"]) == ggml.available()[0]


def test_expert_cost_from_meta_argument_or_preset():
    ex = np.zeros((48, 2, 8), np.int16)
    trace = Trace(ex, {"num_experts": 128, "top_k": 8, "n_moe_layers": 48})
    assert expert_cost(trace) is None
    assert expert_cost(trace, expert_bytes=123).expert_bytes == 123
    qwen = expert_cost(trace, model="qwen3-30b-a3b")
    assert qwen.expert_bytes == 3 * 2048 * 768 * 2 and qwen.expert_flops == 2 * 3 * 2048 * 768
    with pytest.raises(ValueError, match="layers x"):
        expert_cost(trace, model="mixtral-8x7b")


def test_quantized_experts_pay_dequantization_where_the_format_says():
    from expertcache.costmodel import ExpertCost, Hardware, miss_times

    params = 3 * 2048 * 768
    q4k = ExpertCost(3 * 768 * 2048 // 256 * 144, 2.0 * params, compute_bytes=2 * params)
    gpu = Hardware("g", h2d_gbps=25, gpu_mem_gbps=1000, cpu_mem_gbps=50, cpu_gflops=500, transfer_latency_s=0)
    per_load, per_use = miss_times(q4k, gpu, "dequantized"), miss_times(q4k, gpu, "quantized")
    deq = (q4k.expert_bytes + q4k.compute_bytes) / 1e12  # memory bound on a GPU
    assert per_use["hit"] == pytest.approx(per_load["hit"] + deq)
    assert per_use["fetch"] == pytest.approx(per_load["fetch"])  # paid once either way on a miss
    assert q4k.slot_bytes("quantized") * 3 < q4k.slot_bytes("dequantized")
    # a CPU standing in for the device: dequantization at its measured rate, not memory speed
    cpu_device = Hardware("c", h2d_gbps=25, gpu_mem_gbps=1000, cpu_mem_gbps=50, cpu_gflops=500,
                          transfer_latency_s=0, device_dequant_gelems=0.5)
    slow = miss_times(q4k, cpu_device, "quantized")
    assert slow["hit"] == pytest.approx(per_load["hit"] + params / 0.5e9)


def test_a_ggml_miss_of_several_tokens_runs_at_the_quantized_rate():
    from dataclasses import replace

    params = 3 * 2048 * 768
    q4k = ExpertCost(3 * 768 * 2048 // 256 * 144, 2.0 * params, compute_bytes=2 * params)
    probed = replace(HW, cpu_quant_gflops=25.0)
    flops = 8 * 2.0 * params
    assert miss_times(q4k, probed, tokens=8, ggml=True)["cpu"] == pytest.approx(flops / 25e9)
    assert miss_times(q4k, HW, tokens=8, ggml=True)["cpu"] == pytest.approx(flops / 100e9)  # unprobed
    # torch's path dequantizes, then multiplies in float: cpu_gflops, plus the dequantization
    torch_path = miss_times(q4k, probed, tokens=8)["cpu"]
    assert torch_path == pytest.approx(flops / 100e9 + params / (HW.cpu_dequant_gelems * 1e9))
    with pytest.raises(ValueError, match="cpu_quant_gflops must be a positive number or null"):
        replace(HW, cpu_quant_gflops=0)


def test_probe_measures_ggml_where_it_is_installed():
    from expertcache.costmodel.hardware import ggml_rate
    from expertcache.quant import ggml

    rate = ggml_rate(0.05, rows=256, cols=512)
    if not ggml.available()[0]:
        assert rate == {}
        return
    # behaviour, not speed (a loaded 2-core CI machine measured 0.09 GFLOP/s once): one field,
    # a positive finite rate
    assert list(rate) == ["cpu_quant_gflops"]
    assert 0 < rate["cpu_quant_gflops"] < float("inf")
