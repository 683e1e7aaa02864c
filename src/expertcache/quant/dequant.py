"""GGUF blocks -> float tensors with plain torch ops, on whatever device the bytes are.

The runtime calls `dequantize` on the GPU for every step that computes quantized experts, so the
code here is whole-tensor torch ops only: no numpy, no reads of device values on the host, no
Python loops over blocks. Every type in `formats.SUPPORTED` equals `gguf.quants.dequantize` bit
for bit in float32 (tests/test_dequant.py). Other output dtypes are that float32 result cast, so
bf16 slots hold exactly the rounded reference values.

Sources: transformers' torch dequantizer (`transformers.integrations.gguf.dequant`) for the types
it has; Q5_0, Q5_1 (absent there) and MXFP4 in ggml's layout (absent there) are written here after
gguf-py's numpy reference.
"""

from __future__ import annotations

import torch
from transformers.integrations.gguf import dequant as _hf_gguf

from .formats import QuantFormat, check_supported

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# ggml's kvalues_mxfp4: the FP4 E2M1 values doubled, indexed by the nibble (bit 3 is the sign).
# ggml pairs them with half the E8M0 scale (ggml_e8m0_to_fp32_half), and so must we: the products
# are the same numbers, but this way they are the same float32 operations as the reference.
_MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_TABLES: dict[torch.device, torch.Tensor] = {}


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
    blocks = flat.reshape(-1, fmt.block_bytes)  # N blocks, one per row
    own = _OWN.get(fmt.name)
    values = own(blocks) if own else _hf_gguf.dequantize(blocks, fmt.ggml_type, torch.float32)
    return values.reshape(shape).to(dtype)


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
    if flat.storage_offset() % 4:
        flat = flat.clone()
    return flat


def _table(device: torch.device) -> torch.Tensor:
    """The MXFP4 value table on `device`, built once per device (a copy only the first time)."""
    if device not in _TABLES:
        _TABLES[device] = torch.tensor(_MXFP4_DOUBLED, dtype=torch.float32, device=device)
    return _TABLES[device]


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of each block, as float32 `[N, 1]`."""
    return blocks[:, start:start + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[N, 16]` bytes -> `[N, 32]`: low nibbles are elements 0-15, high nibbles 16-31 (ggml)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """`[N, 4]` bytes of a little-endian uint32 -> its 32 bits `[N, 32]`, bit i for element i."""
    shift = torch.arange(8, device=qh.device, dtype=torch.uint8)  # made on the device: no copy
    return ((qh.unsqueeze(-1) >> shift) & 1).reshape(qh.shape[0], 32)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # N blocks x 22 bytes: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles
    q = _nibbles(blocks[:, 6:22]) | (_bits32(blocks[:, 2:6]) << 4)
    return _half(blocks, 0) * (q.to(torch.int8) - 16).float()


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # N blocks x 24 bytes: fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of nibbles
    q = _nibbles(blocks[:, 8:24]) | (_bits32(blocks[:, 4:8]) << 4)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents -> 2^(e-127) / 2 in float32, built from bits as ggml_e8m0_to_fp32_half:
    e < 2 gives the subnormals 2^-128 and 2^-127, which a float exponent field cannot hold."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # N blocks x 17 bytes: one E8M0 exponent, then element j in the low nibble of byte j and
    # element j + 16 in its high nibble
    values = _table(blocks.device)[_nibbles(blocks[:, 1:17]).long()]
    return _e8m0_half(blocks[:, :1]) * values


_OWN = {"Q5_0": _dequant_q5_0, "Q5_1": _dequant_q5_1, "MXFP4": _dequant_mxfp4}
