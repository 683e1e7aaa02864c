"""One expert's size and cost from a model preset, a GGUF file's header or a safetensors checkpoint's (torch-free).

``--model qwen3-30b-a3b --quant Q4_K`` sizes the preset's expert in a ggml block type
(gate and up rows hold ``hidden`` weights, down rows ``expert_ff``); ``--model
model.gguf`` reads the stored sizes and types from the header without loading any
tensor. Quantized experts compute in ``compute_dtype`` (the run's default:
``pool.default_dtype`` of the device), which is what a dequantized slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..presets import preset
from ..quant.formats import check_supported
from .model import ExpertCost
from .pool import COMPUTE_BYTES


@dataclass(frozen=True)
class ModelExperts:
    """Shape of a model's routed experts and what one of them costs."""

    name: str
    layers: int
    experts: int
    top_k: int
    cost: ExpertCost
    quant: str          # e.g. 'Q4_K/Q6_K', 'bf16'
    compute_dtype: str = "bfloat16"  # what quantized experts are dequantized into (float ones: their own)


def model_experts(model: str, quant: str | None = None, dense_bytes: int = 0,
                  compute_dtype: str = "bfloat16") -> ModelExperts:
    """``model``: a preset name, a .gguf path or a safetensors checkpoint directory; ``quant``: a
    ggml type for a preset's experts.

    A GGUF whose layers store different types (llama.cpp's Q4_K_M) is sized by its largest
    layer's expert, as the runtime sizes its quantized slots."""
    if compute_dtype not in COMPUTE_BYTES:
        raise ValueError(f"unknown compute dtype {compute_dtype!r}; use one of {', '.join(COMPUTE_BYTES)}")
    width = COMPUTE_BYTES[compute_dtype]
    if dense_bytes < 0:
        raise ValueError(f"dense bytes must not be negative, got {dense_bytes}")
    if Path(model).is_dir():
        if quant is not None:
            raise ValueError("--quant is for a preset; a checkpoint says its own dtypes")
        return _from_checkpoint(model, dense_bytes, compute_dtype)
    if model.lower().endswith(".gguf") or Path(model).is_file():
        if quant is not None:
            raise ValueError("--quant is for a preset; a GGUF file says its own quant types")
        return _from_gguf(model, dense_bytes, compute_dtype)
    shape = preset(model)
    params = 3 * shape.hidden * shape.expert_ff
    if quant is None:
        cost = ExpertCost(shape.expert_bytes, 2.0 * params, dense_bytes)
        return ModelExperts(shape.name, shape.layers, shape.experts, shape.top_k, cost, shape.dtype, shape.dtype)
    fmt = check_supported(quant, f"--quant for {shape.name}")
    stored = 2 * fmt.nbytes((shape.expert_ff, shape.hidden)) + fmt.nbytes((shape.hidden, shape.expert_ff))
    cost = ExpertCost(stored, 2.0 * params, dense_bytes, compute_bytes=params * width)
    return ModelExperts(shape.name, shape.layers, shape.experts, shape.top_k, cost, fmt.name, compute_dtype)


def _from_gguf(path: str, dense_bytes: int, compute_dtype: str) -> ModelExperts:
    from ..ggufmodel.header import read_header

    header = read_header(path)
    params = header.expert_params
    cost = ExpertCost(header.expert_bytes, 2.0 * params, dense_bytes, compute_bytes=params * COMPUTE_BYTES[compute_dtype])
    types = "/".join(sorted({t for part, names in header.quant_types.items() if part.endswith("weight")
                             for t in names.split("/")}))
    return ModelExperts(Path(path).name, len(header.moe_blocks), header.num_experts, header.top_k, cost, types,
                        compute_dtype)


def _from_checkpoint(path: str, dense_bytes: int, compute_dtype: str) -> ModelExperts:
    """A safetensors checkpoint's experts, from config.json and the tensor headers. Float experts
    compute in their own dtype; FP8 / MXFP4 ones are dequantized into ``compute_dtype``."""
    from ..ggufmodel.safetensors import checkpoint_experts

    shape = checkpoint_experts(Path(path))
    floats = set(shape.dtypes.split("/")) <= {"BF16", "F16", "F32"}
    compute = None if floats else shape.params * COMPUTE_BYTES[compute_dtype]
    cost = ExpertCost(shape.expert_bytes, 2.0 * shape.params, dense_bytes, compute_bytes=compute)
    label = shape.dtypes.lower()
    return ModelExperts(Path(path).name, shape.layers, shape.experts, shape.top_k, cost, label,
                        label if floats else compute_dtype)
