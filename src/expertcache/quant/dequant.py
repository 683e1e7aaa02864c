"""GGUF blocks -> float tensors with plain torch ops, on whatever device the bytes are.

The runtime calls `dequantize` on the GPU for every step that computes quantized experts, so the
code is whole-tensor torch ops: no numpy, no reads of device values on the host, no Python loops
over blocks. Every type in `formats.SUPPORTED` equals `gguf.quants.dequantize` bit for bit in
float32 (tests/test_dequant.py). Other output dtypes are that float32 result cast, so bf16 slots
hold exactly the rounded reference values.

Sources: `kernels.py` (ours, after gguf-py) for the legacy and K types, IQ4_NL/IQ4_XS and MXFP4;
transformers' torch dequantizer (`transformers.integrations.gguf.dequant`) for Q8_0 and the grid
IQ types (IQ1_*, IQ2_*, IQ3_*). Caveat for those grid IQ types: transformers builds small shift
tensors from Python tuples on each call, which on CUDA is a host-to-device copy that waits for
the stream (`HOST_COPY_PER_CALL`); Q4_K/Q6_K/MXFP4-class files do not touch that code.
"""

from __future__ import annotations

from functools import cache

import torch
from transformers.integrations.gguf import dequant as _hf_gguf

from . import kernels
from .formats import QuantFormat, check_supported

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# types whose transformers dequantizer copies a small host tensor to the device on each call
HOST_COPY_PER_CALL = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")


def dequantize(data: torch.Tensor, fmt: str | int | QuantFormat, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`data` (uint8, the row-major quantized bytes of a tensor of logical `shape`; any shape of
    its own) -> a `shape` tensor of `dtype` on `data`'s device."""
    fmt = check_supported(fmt, "dequantize")
    shape = tuple(int(d) for d in shape)
    flat = _flat_bytes(data, fmt, shape)
    if fmt.name in _FLOATS:
        # reinterpret, then one cast: f16/bf16 -> f32 is exact, so any dtype matches the reference
        return flat.view(_FLOATS[fmt.name]).reshape(shape).to(dtype)
    blocks = flat.reshape(-1, fmt.block_bytes)  # N blocks
    own = kernels.BY_NAME.get(fmt.name)
    if own is None and (why := transformers_lacks(fmt.name)):
        raise ValueError(why)
    values = own(blocks) if own else _hf_gguf.dequantize(blocks, fmt.ggml_type, torch.float32)
    return values.reshape(shape).to(dtype)


@cache
def transformers_lacks(name: str) -> str | None:
    """Why the installed transformers cannot dequantize type ``name`` (the types ``kernels.py``
    does not cover come from its GGUF dequantizer), or None when it can. Older releases lack
    some: transformers 5.17 has no IQ1_S ("ggml type 19 is not supported yet"). One zero block
    on the CPU tells, once per type."""
    fmt = check_supported(name, "dequantize")
    if fmt.name in _FLOATS or fmt.name in kernels.BY_NAME:
        return None
    try:
        _hf_gguf.dequantize(torch.zeros(fmt.block_bytes, dtype=torch.uint8), fmt.ggml_type, torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        import transformers

        return (f"{fmt.name} blocks are dequantized by transformers' GGUF dequantizer, and transformers "
                f"{transformers.__version__} has none for it ({e}); upgrade transformers (5.25 has it) or "
                "use a file whose experts are in another type")
    return None


def _flat_bytes(data: torch.Tensor, fmt: QuantFormat, shape: tuple[int, ...]) -> torch.Tensor:
    """`data` as a flat uint8 tensor whose start is aligned for 4-byte views."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"dequantize takes the raw bytes as a uint8 tensor, got {got}: "
                         "pass tensor.view(torch.uint8) or torch.from_numpy(array.view(np.uint8))")
    expected = fmt.nbytes(shape)
    if data.numel() != expected:
        raise ValueError(f"{fmt.name} tensor of shape {shape} takes {expected} bytes, got "
                         f"{data.numel()}: pass exactly one tensor's bytes")
    flat = data.reshape(-1)
    # views as fp16/fp32 need an aligned start; a slice of a mapped file may not have one
    # (traced code skips the check: dynamo cannot read an offset, and the device step traces
    # this on bytes it gathered into a fresh buffer, whose start is aligned)
    if not torch.compiler.is_compiling() and flat.storage_offset() % 4:
        flat = flat.clone()
    return flat
