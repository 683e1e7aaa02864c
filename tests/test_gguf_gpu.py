"""GGUF models on CUDA: both slot formats equal the CPU reference, pinned quantized host bytes,
and no device-to-host sync in a step besides reading the router's choices. Run by
benchmarks/gpu_check.sh."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False); "
                              "run benchmarks/gpu_check.sh on a GPU machine"),
]

import expertcache  # noqa: E402
from cuda_sync import forbid_syncs_in_steps  # noqa: E402
from gguf_models import write_gguf  # noqa: E402
from offload_check import assert_cuda_matches  # noqa: E402
from test_gguf import PROMPT, reference  # noqa: E402


@pytest.mark.parametrize("expert_type", ["Q4_K", "MXFP4"])
@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
def test_cuda_gguf_equals_cpu_reference(tmp_path, expert_type, slot_format):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", expert_type)
    assert_cuda_matches(path, reference(path), PROMPT, slot_format)


@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
def test_cuda_gguf_one_sync_per_step(tmp_path, monkeypatch, slot_format):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q4_K")
    model = expertcache.offload(path, slots=6, device="cuda", slot_format=slot_format)
    calls = forbid_syncs_in_steps(monkeypatch)
    with torch.no_grad():
        model.generate(PROMPT.cuda(), max_new_tokens=8, do_sample=False)
    assert calls["steps"] > 0 and calls["to_host"] == calls["steps"]
