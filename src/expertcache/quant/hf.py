"""HF-native quantized expert layouts -> float tensors, with plain torch ops on any device.

- GPT-OSS MXFP4 (`*_blocks` + `*_scales`): `mxfp4_hf`.
- Block FP8 (DeepSeek-V3, Qwen3-FP8; `float8_e4m3fn` + fp32 `weight_scale_inv`): `fp8_block`.

The runtime keeps GPT-OSS's MXFP4 experts as ggml MXFP4 blocks (`mxfp4_hf_to_ggml`: the same
bytes in another order, repacked once at load) and FP8 experts as their raw bytes (`FP8_E4M3`).

Both compute in float32 and cast once, so every output dtype is the exactly rounded value.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .formats import QuantFormat

# Raw float8_e4m3fn bytes, one per element: not a ggml type (ggml_type -1), so
# `quant.dequant.dequantize` refuses it; `runtime.quantized.Codec` pairs it with its scale part.
FP8_E4M3 = QuantFormat("F8_E4M3", -1, 1, 1)

# FP4 E2M1 values by nibble (bit 3 is the sign), as transformers' FP4_VALUES.
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_TABLES: dict[torch.device, torch.Tensor] = {}


def _fp4_table(device: torch.device) -> torch.Tensor:
    """The E2M1 table on `device`, copied there once."""
    if device not in _TABLES:
        _TABLES[device] = torch.tensor(_FP4, dtype=torch.float32, device=device)
    return _TABLES[device]


def mxfp4_hf(blocks: torch.Tensor, scales: torch.Tensor,
             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """GPT-OSS MXFP4 -> `[..., R, C]` of `dtype`.

    `blocks [..., R, C/32, 16]` uint8 and `scales [..., R, C/32]` uint8 (E8M0, bias 127), as in
    the checkpoint (`gate_up_proj_blocks [E, 2I, H/32, 16]`). Within a 32-element block, byte j
    holds element 2j in its low nibble and element 2j+1 in its high nibble (ggml's GGUF MXFP4
    instead puts element j low and j+16 high; the E8M0 scale byte means the same in both).

    Relation to transformers: for 4-D blocks `[E, R, G, 16]`,
    `convert_moe_packed_tensors(blocks, scales, dtype=d) == mxfp4_hf(blocks, scales, d)
    .transpose(1, 2)`, bit for bit: transformers also transposes to GPT-OSS's `[E, C, R]`
    parameter layout (`gate_up_proj [E, H, 2I]`); this function keeps the checkpoint's
    row-major `[E, R, C]`, the layout every other family's experts use.
    """
    _check_mxfp4(blocks, scales)
    # ... leading dims, R rows, G blocks per row
    nibbles = torch.stack([blocks & 0xF, blocks >> 4], dim=-1)  # [..., R, G, 16, 2]: even, odd
    values = _fp4_table(blocks.device)[nibbles.long()].flatten(-2, -1)  # [..., R, G, 32]
    # ldexp rather than a product with 2^(e-127): at e = 255, 2^128 overflows, while ldexp gives
    # finite values for 0.5 and 0.0 as transformers' ldexp does
    exponent = (scales.to(torch.int32) - 127).unsqueeze(-1)  # [..., R, G, 1]
    return torch.ldexp(values, exponent).flatten(-2, -1).to(dtype)  # [..., R, G * 32]


def mxfp4_hf_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS MXFP4 -> ggml MXFP4 bytes `[..., R, C/32 * 17]` uint8 on the host, no value changes.

    Both formats are 32 E2M1 values and one E8M0 scale byte per block; only the nibble order
    differs (HF: element 2j low, 2j+1 high; ggml: element j low, j+16 high) and ggml puts the
    scale byte first. So `dequant.dequantize(mxfp4_hf_to_ggml(b, s), "MXFP4", (R, C))` equals
    `mxfp4_hf(b, s)` bit for bit (tests/test_hf_quant.py), and the ggml path serves both.

    A load-time step, in numpy on 64-bit words: HF's 16 bytes are two words, elements 0-15 (a)
    and 16-31 (c); ggml byte 2i is (a_i low nibble, c_i low nibble), byte 2i+1 (a_i high,
    c_i high). About 1 GB/s on this project's CPU, where torch's uint8 ops ran 100x slower.
    """
    _check_mxfp4(blocks, scales)
    if sys.byteorder != "little":  # the word trick reads byte i of a word as element i
        raise RuntimeError("mxfp4_hf_to_ggml assumes a little-endian host")
    words = blocks.detach().cpu().contiguous().numpy().reshape(-1, 2, 8).view(np.uint64)[..., 0]  # [N, 2]
    a, c = words[:, 0], words[:, 1]
    even = (a & _LOW) | ((c << _FOUR) & _HIGH)     # ggml bytes 0, 2, ..: element j low, j + 16 high
    odd = ((a >> _FOUR) & _LOW) | (c & _HIGH)      # ggml bytes 1, 3, ..
    out = np.empty((words.shape[0], 17), dtype=np.uint8)
    out[:, 0] = scales.detach().cpu().contiguous().numpy().reshape(-1)
    out[:, 1::2] = even.view(np.uint8).reshape(-1, 8)
    out[:, 2::2] = odd.view(np.uint8).reshape(-1, 8)
    return torch.from_numpy(out).reshape(*scales.shape[:-1], scales.shape[-1] * 17)


_LOW, _HIGH, _FOUR = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0xF0F0F0F0F0F0F0F0), np.uint64(4)


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8 tensors, got {blocks.dtype} and "
                         f"{scales.dtype}: pass the checkpoint's *_blocks and *_scales unchanged")
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 needs blocks [..., R, C/32, 16] and scales [..., R, C/32], got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")


def fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block FP8 -> `[..., R, C]` of `dtype`: each `block[0] x block[1]` tile of `weight`
    (float8_e4m3fn `[..., R, C]`) times its entry of `scale_inv` (`[..., ceil(R/b0), ceil(C/b1)]`;
    despite the name it multiplies). Edge tiles may be partial when R or C is not a multiple.
    Only e4m3fn: the block-FP8 MoE checkpoints (DeepSeek-V3, Qwen3-FP8) store that.

    Equals transformers' `finegrained_fp8._dequantize_fp8_weight(weight, scale_inv, block,
    torch.float32)` bit for bit on any shape (the same in-place products), and its loader's
    `Fp8Dequantize._dequantize_one` for every output dtype where that one applies (whole tiles).
    `_dequantize_fp8_weight` with a bf16 dtype rounds the scales to bf16 first; this does not.
    """
    rows, cols = _check_fp8(weight, scale_inv, block)
    b0, b1 = block
    full, rem = divmod(cols, b1)
    out = weight.to(torch.float32)  # a fresh tensor: the products below happen in place in it
    # scales expanded over rows only (R, not R x C, floats), broadcast over columns by a view;
    # expand + flatten is repeat_interleave with the output size known on the host (no sync)
    scale = scale_inv.to(torch.float32).unsqueeze(-2)  # [..., nR, 1, nC]
    scale = scale.expand(*scale.shape[:-2], b0, scale.shape[-1]).flatten(-3, -2)[..., :rows, :]
    out[..., :full * b1].unflatten(-1, (full, b1)).mul_(scale[..., :full, None])
    if rem:
        out[..., full * b1:].mul_(scale[..., full:])
    return out.to(dtype)


def _check_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int]) -> tuple[int, int]:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block FP8 weights are float8_e4m3fn, got {weight.dtype}")
    if not scale_inv.dtype.is_floating_point:
        raise ValueError(f"weight_scale_inv must be a float tensor, got {scale_inv.dtype}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block is (rows, cols) of one scale tile, e.g. (128, 128), got {block}")
    rows, cols = weight.shape[-2:]
    grid = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} with {tuple(block)} tiles needs "
                         f"weight_scale_inv {grid}, got {tuple(scale_inv.shape)}")
    return rows, cols
