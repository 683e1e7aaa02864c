"""HF-native quantized checkpoints on CUDA: GPT-OSS MXFP4 and block FP8 equal their CPU references
in both slot formats, host bytes are pinned, and a step syncs only to read the router's choices.

References are computed on the CPU: transformers' own dequantizing load for MXFP4
(``Mxfp4Config(dequantize=True)``; on a GPU without triton kernels it would dequantize anyway) and
the fp8_block-dequantized float model for FP8 (on an FP8-capable GPU transformers would keep FP8
and run its own kernels, so it is no dequantized reference there). Not yet run on a GPU.
"""

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
from offload_check import assert_cuda_matches  # noqa: E402
from test_hf_quant import PROMPT, fp8_reference, transformers_reference, write_fp8, write_gpt_oss_mxfp4  # noqa: E402


def _checkpoint(kind: str, path):
    if kind == "mxfp4":
        return path, transformers_reference(write_gpt_oss_mxfp4(path))
    path, float_model = write_fp8(path, ff=192)  # partial tiles
    return path, fp8_reference(path, float_model)


@pytest.mark.parametrize("kind", ["mxfp4", "fp8"])
@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
def test_cuda_hf_quant_equals_cpu_reference(tmp_path, kind, slot_format):
    path, ref = _checkpoint(kind, tmp_path)
    assert_cuda_matches(path, ref, PROMPT, slot_format)


@pytest.mark.parametrize("kind", ["mxfp4", "fp8"])
def test_cuda_hf_quant_one_sync_per_step(tmp_path, monkeypatch, kind):
    path, _ = _checkpoint(kind, tmp_path)
    model = expertcache.offload(path, slots=6, device="cuda", slot_format="quantized")
    calls = forbid_syncs_in_steps(monkeypatch)
    with torch.no_grad():
        model.generate(PROMPT.cuda(), max_new_tokens=8, do_sample=False)
    assert calls["steps"] > 0 and calls["to_host"] == calls["steps"]
