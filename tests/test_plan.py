"""``expertcache plan`` and quantized expert sizes in the simulator (header only, torch-free)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import expertcache
from expertcache.cli import main
from expertcache.costmodel import load_hardware, model_experts
from expertcache.quant.ggml import available as ggml_available
from expertcache.sim.plan import cpu_kernel, plan, pool_slots
from gguf_models import write_gguf


def test_preset_in_q4_k_is_the_known_size():
    q = model_experts("qwen3-30b-a3b", "Q4_K")
    # 3 matrices of 768 x 2048 weights at 144 bytes per 256: 2.53 MiB (Q4_K_M mixes in Q6_K: 2.72)
    assert q.cost.expert_bytes == 3 * 768 * 2048 // 256 * 144
    assert q.cost.compute_bytes == 3 * 768 * 2048 * 2 and q.cost.quantized
    assert not model_experts("qwen3-30b-a3b").cost.quantized
    with pytest.raises(ValueError, match="unknown quant type 'Q9'"):
        model_experts("qwen3-30b-a3b", "Q9")


def test_plan_slots_equal_the_runtime_sizing(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q4_0", experts=32)
    model = model_experts(str(path), compute_dtype="float32")  # the CPU runtime computes in float32
    budget = 8 * 2 ** 20
    for kernel in ("auto", "torch"):
        ggml = cpu_kernel(model, kernel)[0] == "ggml"
        for fmt in ("quantized", "dequantized"):
            live = expertcache.offload(path, gpu_memory=budget, slot_format=fmt, cpu_kernel=kernel).expertcache
            direct = ggml and fmt == "quantized" and live.device.type == "cpu"  # ggml reads CPU slots: no scratch
            assert live.direct == direct
            assert pool_slots(model, budget, fmt, direct=direct) == live.pool.slots, (kernel, fmt)


def test_plan_promises_the_slots_the_run_builds(tmp_path):
    """The plan sizes slots as the run will: the device's compute dtype (float32 on the CPU,
    where plan once sized bf16 and promised twice the slots) and slot format, its staging."""
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q4_0", experts=32)
    out, budget = tmp_path / "plan.json", "8MiB"
    for kernel in ("auto", "torch"):  # with ggml (when installed) quantized CPU slots, no scratch
        assert main(["plan", str(path), "--gpu-memory", budget, "--device", "cpu", "--cpu-kernel", kernel,
                     "--json", str(out)]) == 0
        planned = json.loads(out.read_text())
        fmt, ggml = planned["run_slot_format"], planned["cpu_kernel"] == "ggml"
        assert ggml == (kernel == "auto" and ggml_available()[0])
        assert (planned["device"], planned["compute_dtype"], fmt) == \
            ("cpu", "float32", "quantized" if ggml else "dequantized")
        model = model_experts(str(path), compute_dtype=planned["compute_dtype"])
        for miss in ("fetch", "cpu"):  # misses on the CPU keep no staging slots: more cache slots
            live = expertcache.offload(path, gpu_memory=budget, device="cpu", miss=miss,
                                       cpu_kernel=kernel).expertcache
            assert live.cpu_kernel == planned["cpu_kernel"]
            assert live.slot_format == fmt
            assert live.pool.slots == pool_slots(model, 8 * 2 ** 20, fmt, miss, direct=ggml)
            assert live.pool.slots < live.num_layers * live.num_experts  # sized by the budget, not capped
            if miss == "fetch":
                assert planned["slots"][fmt] == live.pool.slots
    assert main(["plan", str(path), "--gpu-memory", budget, "--json", str(out)]) == 0
    import torch

    assert json.loads(out.read_text())["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_plan_ranks_configurations_and_recommends_the_fastest(tmp_path):
    model = model_experts("qwen3-30b-a3b", "Q4_K")
    from expertcache.trace.synth import synth_trace

    trace = synth_trace("qwen3-30b-a3b", 300)
    result = plan(model, "8GiB", load_hardware("pcie4-consumer"), trace, ["lru"])
    slots = result["slots"]
    assert slots["quantized"] > 3 * slots["dequantized"] > 0
    speeds = [r["tok_s"] for r in result["rows"]]
    assert speeds == sorted(speeds, reverse=True)
    best = result["best"]
    assert best == result["rows"][0] and best["slots"] > 0  # a cache beats both baselines here
    cep = next(r for r in result["rows"] if r["config"] == "copy-every-pass")
    assert best["tok_s"] > cep["tok_s"]
    assert {r["miss_path"] for r in result["rows"]} == {"fetch", "cpu", "auto"}


def test_plan_cli_without_a_trace_gives_slot_counts_and_no_verdict(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q4_K", down_type="Q6_K")
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--gpu-memory", "4MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "quantized slots" in text and "give --trace" in text
    result = json.loads(out.read_text())
    assert result["best"] is None and result["quant"] == "Q4_K/Q6_K"
    assert main(["plan", str(path), "--gpu-memory", "4MiB", "--json", str(tmp_path / "no" / "x.json")]) == 2


def test_plan_reads_only_the_header(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    code = ("import sys; from expertcache.cli import main; main(['plan', sys.argv[1], '--gpu-memory', '4MiB']); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("NO-TORCH")


def test_sim_takes_the_quant_type(code_trace_path, tmp_path):
    trace = code_trace_path
    out_bf16, out_q = tmp_path / "bf16.json", tmp_path / "q4k.json"
    common = ["sim", str(trace), "--policy", "lru", "--fraction", "0.25", "--tokens", "300",
              "--model", "qwen3-30b-a3b"]
    assert main(common + ["--json", str(out_bf16)]) == 0
    assert main(common + ["--quant", "Q4_K", "--slot-format", "quantized", "--json", str(out_q)]) == 0
    bf16, q = (json.loads(p.read_text()) for p in (out_bf16, out_q))
    assert q["cost_model"]["expert_bytes"] * 3 < bf16["cost_model"]["expert_bytes"]
    assert q["results"][0]["bytes_moved"] * 3 < bf16["results"][0]["bytes_moved"]
    assert q["results"][0]["misses"] == bf16["results"][0]["misses"]  # same slots, same replay
    assert main(["sim", str(trace), "--tokens", "50", "--quant", "Q4_K"]) == 2  # needs --model


def test_plan_requests_scores_policies_under_batched_decode(tmp_path, capsys):
    # 16 requests of a synthetic Qwen3 trace at 2 GiB of Q4_K slots: the batched hit rates
    # are lower than one stream's (a pass needs more keys than fit), and the note says why.
    out = {}
    for b in (1, 16):
        js = tmp_path / f"b{b}.json"
        assert main(["plan", "qwen3-30b-a3b", "--quant", "Q4_K", "--gpu-memory", "2GiB",
                     "--tokens", "640", "--requests", str(b), "--policy", "default",
                     "--device", "cuda", "--json", str(js)]) == 0
        out[b] = json.loads(js.read_text())
    assert "cut into 16 requests" in capsys.readouterr().out
    hit = {b: max(r["hit_rate"] or 0 for r in out[b]["rows"]) for b in out}
    assert 0 < hit[16] < hit[1]
