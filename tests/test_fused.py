"""The fused MoE kernel's host side (runtime/fused.py), without Triton: how pairs are sorted into
blocks on the device, and which experts and slots the kernel refuses, with the reason reported.

The kernel itself runs under Triton's interpreter in tests/kernels/ (the vLLM venv has Triton)
and on CUDA in tests/test_fused_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from expertcache.quant.formats import quant_format
from expertcache.runtime import fused
from expertcache.runtime.fused import align, float_layout, module_refusal, quant_layout
from expertcache.runtime.quantized import Codec, Kind, Part
from tiny_moe import tiny_model


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_puts_every_pair_once_in_a_block_of_its_row(seed, block_m):
    g = torch.Generator().manual_seed(seed)
    T, K, size = int(torch.randint(1, 9, (1,), generator=g)), 4, int(torch.randint(1, 12, (1,), generator=g))
    rows = torch.randint(0, size + 2, (T, K), generator=g)       # ids >= size: not computed here
    rows[0, 0] = -1                                             # a negative id neither
    pair_ids, block_rows = align(rows, size, block_m)
    N = T * K
    NB = -(-(N + min(N, size) * (block_m - 1)) // block_m)
    assert pair_ids.shape == (NB * block_m,) and block_rows.shape == (NB,)   # from T*K and the pool's size only
    flat = rows.reshape(-1)
    seen = []
    for b in range(NB):
        pairs = [p for p in pair_ids[b * block_m:(b + 1) * block_m].tolist() if p < N]
        if block_rows[b] < 0:
            assert pairs == []                                   # an unused block holds nothing
            continue
        assert pairs and all(flat[p] == block_rows[b] for p in pairs)
        seen += pairs
    want = [p for p in range(N) if 0 <= flat[p] < size]
    assert sorted(seen) == want                                  # each computed pair exactly once


def test_align_grid_follows_the_pairs_not_the_pool():
    rows = torch.tensor([[3, 5000]])
    small, large = align(rows, 384, 16), align(rows, 6144, 16)
    assert small[1].shape == large[1].shape == (2,)              # 2 pairs: at most 2 blocks
    assert large[1].tolist() == [3, 5000] and small[1].tolist() == [3, -1]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "qwen2_moe"])
def test_silu_gated_families(family):
    experts = next(m for n, m in tiny_model(family).named_modules() if n.endswith("mlp.experts"))
    assert fused.module_gate(experts) == fused.Gate(fused.SILU, False)


def test_gpt_oss_gate_is_probed_with_its_own_alpha_and_limit():
    experts = tiny_model("gpt_oss").model.layers[0].mlp.experts
    assert fused.module_gate(experts) == fused.Gate(fused.GPT_OSS, True, experts.alpha, experts.limit)


def test_other_gates_are_refused_by_name():
    class Clamped(torch.nn.Module):  # DeepSeek-V4's kind: SiLU-gated, but clamped
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate.clamp(max=5)) * up

    assert "Clamped's gate is neither" in module_refusal(Clamped())
    ungated = Clamped()
    ungated.has_gate = False
    assert "ungated" in module_refusal(ungated)


def test_layouts_of_float_slots_read_in_place_with_strides():
    S, I, H = 3, 4, 8
    pool = {"gate_up_proj": torch.zeros(S, 2 * I, H, dtype=torch.bfloat16),
            "down_proj": torch.zeros(S, H, I, dtype=torch.bfloat16)}
    lay = float_layout(pool, False)
    assert (lay.hidden, lay.inter, lay.size) == (H, I, S)
    assert lay.up.off == I * H and lay.up.tensor is pool["gate_up_proj"]      # the same bytes, no copy
    assert (lay.gate.row, lay.gate.col, lay.biases) == (H, 1, None)
    t = float_layout({"gate_up_proj": torch.zeros(S, H, 2 * I), "down_proj": torch.zeros(S, I, H)}, True)
    assert (t.hidden, t.inter, t.gate.row, t.gate.col) == (H, I, 1, 2 * I)    # [in, out]: strides swap
    # GPT-OSS: [in, out], gate on even outputs, up on odd ones, biases likewise
    oss = fused.Gate(fused.GPT_OSS, True, 1.702, 7.0)
    t = float_layout({"gate_up_proj": torch.zeros(S, H, 2 * I), "down_proj": torch.zeros(S, I, H),
                      "gate_up_proj_bias": torch.zeros(S, 2 * I), "down_proj_bias": torch.zeros(S, H)}, True, oss)
    assert (t.gate.off, t.gate.row, t.up.off, t.up.row) == (0, 2, 1, 2)
    assert [(b.step, b.off) for b in t.biases] == [(2, 0), (2, 1), (1, 0)]
    assert "pool kinds" in float_layout({**pool, "up_proj_bias": torch.zeros(S, H)}, False)
    assert "float32, float16 or bfloat16" in float_layout({k: v.to(torch.int8) for k, v in pool.items()}, False)


def _codec(fmt: str, join: str = "concat") -> Codec:
    f = quant_format(fmt)
    if join == "one":
        parts = (Part("gu", f, (512, 256)), Part("d", f, (256, 256)))
        kinds = (Kind("gate_up_proj", "one", ("gu",)), Kind("down_proj", "one", ("d",)))
    else:
        parts = (Part("g", f, (256, 256)), Part("u", f, (256, 256)), Part("d", f, (256, 256)))
        kinds = (Kind("gate_up_proj", join, ("g", "u")), Kind("down_proj", "one", ("d",)))
    return Codec(parts, kinds, torch.bfloat16)


@pytest.mark.parametrize("fmt", sorted(fused.QUANT))
def test_layouts_of_quantized_slots_address_ggml_rows(fmt):
    codec = _codec(fmt)
    pool = {p.name: torch.zeros(5, p.nbytes + 7, dtype=torch.uint8) for p in codec.parts}  # slots may be wider
    lay = quant_layout(pool, codec)
    row_bytes = quant_format(fmt).row_bytes(256)
    assert lay.gate.row == lay.down.row == row_bytes and lay.gate.slot == codec.part["g"].nbytes + 7
    assert (lay.gate.fmt, lay.up.off, lay.size, lay.dtype) == (fused.QUANT[fmt], 0, 5, torch.bfloat16)
    one = _codec(fmt, "one")
    pool = {p.name: torch.zeros(5, p.nbytes, dtype=torch.uint8) for p in one.parts}
    lay = quant_layout(pool, one)
    assert lay.gate.tensor is lay.up.tensor and lay.up.off == 256 * row_bytes   # up rows after the gate rows
    oss = quant_layout(pool, one, fused.Gate(fused.GPT_OSS, True, 1.702, 7.0))
    assert (oss.gate.off, oss.up.off, oss.up.row) == (0, row_bytes, 2 * row_bytes)  # interleaved rows


def test_quantized_refusals_name_the_reason():
    iq = _codec("IQ4_XS")
    pool = {p.name: torch.zeros(2, p.nbytes, dtype=torch.uint8) for p in iq.parts}
    assert "IQ4_XS" in quant_layout(pool, iq)
    inter = _codec("Q4_K", "interleave")   # GPT-OSS's join, with a first-half gate: not what the module reads
    pool = {p.name: torch.zeros(2, p.nbytes, dtype=torch.uint8) for p in inter.parts}
    assert "'interleave'" in quant_layout(pool, inter) and "first-half gate rows" in quant_layout(pool, inter)
    assert isinstance(quant_layout(pool, inter, fused.Gate(fused.GPT_OSS, True, 1.702, 7.0)), fused.Layout)


def test_the_report_says_which_kernel_runs_and_why(monkeypatch):
    from expertcache import offload

    model = offload(tiny_model("qwen3_moe"), slots=4)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]))
    pool = model.expertcache.stats().pool
    assert pool["expert_kernel"] == "matmul loop" and "runs on CUDA" in pool["expert_kernel_reason"]
    assert model.expertcache.summary()["expert_kernel"] == "matmul loop"
    assert "expert kernel: matmul loop" in str(model.expertcache.stats())
    monkeypatch.setattr(fused, "ENABLED", False)
    assert "ENABLED = False" in model.expertcache.stats().pool["expert_kernel_reason"]


def test_no_triton_means_the_torch_path(monkeypatch):
    fused.triton_refusal.cache_clear()
    real = __import__

    def no_triton(name, *args, **kwargs):
        if name == "triton":
            raise ImportError("no triton here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", no_triton)
    try:
        assert fused.device_refusal(torch.device("cuda")) == "Triton is not installed"
    finally:
        fused.triton_refusal.cache_clear()


def test_bench_fused_rehearses_on_the_cpu(tmp_path, capsys):
    """benchmarks/bench_fused.py --device cpu: toy sizes; here (no Triton) the fused rows say why
    they are skipped and the old path is still timed."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_fused", Path(__file__).parents[1] / "benchmarks" / "bench_fused.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    figures = json.loads((tmp_path / "b.json").read_text())
    assert {(r["format"], r["pool_rows"]) for r in figures["rows"]} == {(f, p) for f in ("bf16", "Q4_K") for p in (8, 16, 32)}
    assert all(r["old_s"] > 0 and r["bytes_read_per_token"] > 0 for r in figures["rows"])
    if fused.triton_refusal() is not None:
        assert "the fused kernel's rows are skipped" in out
