"""Quantized tensor formats: names, block sizes and byte counts (torch-free).

The simulator and the header-only `plan` command size experts with this module, so it imports
`gguf` (numpy) and never torch. Sizes come from `gguf.constants.GGML_QUANT_SIZES` (gguf-py keeps
them in step with ggml-common.h), never from a hand table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# The types `expertcache.quant.dequant.dequantize` handles, bit for bit equal to
# `gguf.quants.dequantize`: plain floats, the legacy and K block types, the IQ types that
# transformers' torch dequantizer covers, and MXFP4 (GPT-OSS). Left out: Q8_1 and Q8_K
# (activation-only types, never stored in model files), TQ1_0/TQ2_0, NVFP4 and Q1_0 (no torch
# dequantizer yet), integer and F64 tensors (not weights).
SUPPORTED: tuple[str, ...] = (
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "MXFP4",
)


@dataclass(frozen=True)
class QuantFormat:
    """One ggml tensor type: `block_elements` values stored in `block_bytes` bytes."""

    name: str
    ggml_type: int
    block_elements: int
    block_bytes: int

    @property
    def supported(self) -> bool:
        return self.name in SUPPORTED

    def row_bytes(self, elements: int) -> int:
        """Bytes of one row of `elements` values (blocks never straddle rows)."""
        if elements < 0 or elements % self.block_elements:
            raise ValueError(f"{self.name} needs rows that are multiples of {self.block_elements} "
                             f"elements, got a row of {elements}")
        return elements // self.block_elements * self.block_bytes

    def nbytes(self, shape: tuple[int, ...] | list[int]) -> int:
        """Bytes of a row-major tensor of logical `shape`; its last dimension is the row."""
        shape = tuple(int(d) for d in shape)
        if not shape:
            raise ValueError(f"{self.name} tensors need at least one dimension, got shape ()")
        return math.prod(shape[:-1]) * self.row_bytes(shape[-1])


def _format(qtype: GGMLQuantizationType) -> QuantFormat:
    elements, nbytes = GGML_QUANT_SIZES[qtype]
    return QuantFormat(qtype.name, int(qtype), elements, nbytes)


_BY_NAME = {q.name: q for q in GGMLQuantizationType if q in GGML_QUANT_SIZES}


def _unknown(x: object) -> ValueError:
    return ValueError(f"unknown quant type {x!r}: expected one of {', '.join(_BY_NAME)} "
                      f"(supported for dequantization: {', '.join(SUPPORTED)})")


def quant_format(x: str | int | GGMLQuantizationType | QuantFormat) -> QuantFormat:
    """A format from its ggml name ("Q4_K", any case), ggml type id, or `GGMLQuantizationType`."""
    if isinstance(x, QuantFormat):
        return x
    if isinstance(x, str):
        qtype = _BY_NAME.get(x.strip().upper())
    elif isinstance(x, int) and not isinstance(x, bool):  # IntEnum members are ints too
        qtype = next((q for q in _BY_NAME.values() if int(q) == int(x)), None)
    else:
        raise TypeError(f"a quant type is a name, a ggml type id or a GGMLQuantizationType, "
                        f"not {type(x).__name__}")
    if qtype is None:
        raise _unknown(x)
    return _format(qtype)


def check_supported(fmt: str | int | GGMLQuantizationType | QuantFormat, what: str) -> QuantFormat:
    """`fmt` as a QuantFormat, or a one-line ValueError naming the type and `what` (a tensor)."""
    fmt = quant_format(fmt)
    if not fmt.supported:
        raise ValueError(f"{what}: quant type {fmt.name} cannot be dequantized by expertcache "
                         f"(supported: {', '.join(SUPPORTED)})")
    return fmt
