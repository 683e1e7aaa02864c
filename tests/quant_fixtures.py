"""Valid random GGUF blocks for every type expertcache dequantizes, and how to write them.

`random_blocks(fmt, rows, cols, rng)` -> uint8 `[rows, row_bytes]`. Types gguf-py can quantize
(F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, MXFP4) are random floats quantized by gguf-py, so they
look like real weights. The rest (K-quants, IQ types), and every block type with `quantize=False`,
are random bytes with each fp16 scale field overwritten by a small finite value: every other bit
pattern of those blocks is a legal file, so random bytes reach every code path.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from expertcache.quant.formats import QuantFormat, check_supported

# byte offsets of the fp16 scale fields in one block (ggml-common.h)
_HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
_QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")


def random_blocks(fmt: str | int | QuantFormat, rows: int, cols: int, rng: np.random.Generator,
                  *, quantize_floats: bool = True) -> np.ndarray:
    """Valid random bytes of a `[rows, cols]` tensor of `fmt`: uint8 `[rows, row_bytes]`."""
    fmt = check_supported(fmt, "random_blocks")
    row_bytes = fmt.row_bytes(cols)
    if fmt.name in _QUANTIZABLE and (quantize_floats or fmt.block_elements == 1):
        floats = rng.standard_normal((rows, cols)).astype(np.float32)
        out = quantize(floats, GGMLQuantizationType(fmt.ggml_type)).view(np.uint8)
        return np.ascontiguousarray(out).reshape(rows, row_bytes)
    blocks = rng.integers(0, 256, (rows, cols // fmt.block_elements, fmt.block_bytes), np.uint8)
    for start in _HALF_FIELDS.get(fmt.name, ()):
        blocks[..., start:start + 2] = _small_halves(rng, blocks.shape[:2])
    if fmt.name == "IQ1_M":
        _set_iq1_m_scale(blocks, _small_halves(rng, blocks.shape[:2]))
    if fmt.name == "MXFP4":
        # E8M0 exponents near 127: scales 2^-17..2^13, products stay finite
        blocks[..., 0] = rng.integers(110, 141, blocks.shape[:2], dtype=np.uint8)
    return blocks.reshape(rows, row_bytes)


def _small_halves(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """fp16 values of either sign, |x| in [1e-3, 0.1], as uint8 `[*shape, 2]`."""
    x = rng.uniform(1e-3, 0.1, shape) * rng.choice([-1.0, 1.0], shape)
    return x.astype(np.float16).view(np.uint8).reshape(*shape, 2)


def _set_iq1_m_scale(blocks: np.ndarray, half: np.ndarray) -> None:
    """IQ1_M spreads its fp16 scale over the top nibbles of the four uint16 words at 48:56."""
    bits = half.view(np.uint16)[..., 0].astype(np.uint16)
    words = blocks[..., 48:56].copy().view(np.uint16)  # [rows, blocks, 4]
    for k in range(4):
        nibble = (bits >> np.uint16(4 * k)) & np.uint16(0xF)
        words[..., k] = (words[..., k] & np.uint16(0x0FFF)) | (nibble << np.uint16(12))
    blocks[..., 48:56] = words.view(np.uint8)


def write_tensor(writer: GGUFWriter, name: str, blocks: np.ndarray, fmt: str | QuantFormat,
                 logical_shape: tuple[int, ...]) -> None:
    """Add raw quantized `blocks` as tensor `name` of row-major `logical_shape` (e.g. `[E, I, H]`).

    gguf-py's convention: with `raw_dtype` set, a uint8 array's *last* dimension is read as bytes
    per row and converted back to elements (quant_shape_from_byte_shape), and the file lists the
    dimensions innermost first. So pass the bytes shaped `[*logical_shape[:-1], row_bytes]`.
    """
    fmt = check_supported(fmt, name)
    byte_shape = (*logical_shape[:-1], fmt.row_bytes(logical_shape[-1]))
    if blocks.dtype != np.uint8 or blocks.size != int(np.prod(byte_shape)):
        raise ValueError(f"{name}: expected {int(np.prod(byte_shape))} uint8 bytes for {fmt.name} "
                         f"{tuple(logical_shape)}, got {blocks.size} {blocks.dtype}")
    qtype = GGMLQuantizationType(fmt.ggml_type)
    writer.add_tensor(name, blocks.reshape(byte_shape), raw_dtype=qtype)
